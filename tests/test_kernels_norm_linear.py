"""The residual add + norm + product kernel (`kernels.norm_linear`) against exact arithmetic and its reference: in
interpret mode on the CPU, lowered for the H200, and compiled on the GPU (`-m gpu`) at the 4B shapes.

Tolerances. h' is `residual_norm`'s, with that test's bound (tests/test_kernels_residual_norm.py: the partials
and the squares summed in another order can flip a rounding, one bf16 step, under 1% of values). y is held to
the exact product of the exact norm, y* = (h' s (1 + w)) @ W^T in float64 with h' the reference's:
- the operand is rounded to bf16 once, before the scaling here and after it in the reference: at most u = 2^-8
  of each term, so u (|x*| @ |W|^T);
- the K fp32 products summed in some order: K 2^-24 (|x*| @ |W|^T) (linear's test);
- the row's scale s from another order of the squares: a few fp32 ulps of y, inside the next term;
- y rounded to bf16: u |y*|;
- an h' element one step off (the rare flip above) moves y by that step times s |1 + w| |W|.
A wrong part, a dropped K step, a missing scale or a wrong row moves y by O(|x*| @ |W|^T), far outside.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels.linear import LinearTuning, linear_pallas
from qwen35_jax.kernels.norm_linear import NormLinearTuning, fuses, norm_linear_pallas, norm_linear_ref
from qwen35_jax.kernels.residual_norm import residual_delta, residual_norm_pallas

U = 2.0**-8  # bf16's unit roundoff
STEP = 2.0**-7  # one bf16 step, relative, at most
EPS = 1e-6
# Up to 4 rows, one K split: the test shapes are narrower than the 4B products, and rows past the model's 1 must
# work for a tuning that asks for them.
ONE_SPLIT = NormLinearTuning(max_rows=4, linear=LinearTuning(splits=1))


def case(rows, width, n, splits, seed=0):
    kh, kp, kw, kl = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(kh, (rows, width)).astype(jnp.bfloat16)
    parts = (jax.random.normal(kp, (splits, rows, width)) / splits).astype(jnp.float32 if splits > 1 else jnp.bfloat16)
    norm_weight = (0.1 * jax.random.normal(kw, (width,))).astype(jnp.bfloat16)
    weight = (jax.random.normal(kl, (n, width)) / np.sqrt(width)).astype(jnp.bfloat16)
    return h, parts, norm_weight, weight


def assert_within_bounds(args, new_h, y):
    h, parts, norm_weight, weight = (np.float64(np.float32(a)) for a in args)
    delta = np.float64(np.float32(residual_delta(args[1], jnp.bfloat16)))
    ref_h = np.float64(np.float32(norm_linear_ref(*args, EPS)[0]))
    tol_h = STEP * (np.abs(delta) + np.abs(ref_h)) + 1e-6
    err_h = np.abs(np.float64(np.float32(new_h)) - ref_h)
    assert np.all(err_h <= tol_h), f"h: max err {err_h.max():.3g}"
    assert np.mean(err_h > 0) < 0.01, f"h: {np.mean(err_h > 0):.1%} of values differ (rounding flips only)"
    scale = 1.0 / np.sqrt(np.mean(ref_h**2, axis=-1, keepdims=True) + EPS)
    gain = scale * np.abs(1.0 + norm_weight)
    x = ref_h * scale * (1.0 + norm_weight)
    exact, magnitude = x @ weight.T, np.abs(x) @ np.abs(weight).T
    bound = (U + h.shape[-1] * 2.0**-24) * magnitude + U * np.abs(exact) + (tol_h * gain) @ np.abs(weight).T + 1e-6
    err = np.abs(np.float64(np.float32(y)) - exact)
    assert np.all(err <= bound), f"y: max err {err.max():.3g}, bound there {bound.flat[np.argmax(err - bound)]:.3g}"


@pytest.mark.parametrize(
    "rows, width, n, splits",
    [(1, 2560, 512, 4), (3, 2560, 256, 1), (4, 256, 64, 3), (2, 384, 96, 4)],
    ids=["4b-width-split-parts", "one-bf16-part", "power-of-two", "narrow"],
)
def test_fused_kernel_within_bounds(rows, width, n, splits):
    args = case(rows, width, n, splits)
    assert fuses(args[0].shape, args[3].shape, ONE_SPLIT)
    new_h, y = jax.jit(lambda *a: norm_linear_pallas(*a, EPS, tuning=ONE_SPLIT, interpret=True))(*args)
    assert new_h.dtype == y.dtype == jnp.bfloat16 and new_h.shape == (rows, width) and y.shape == (rows, n)
    assert_within_bounds(args, new_h, y)
    assert_within_bounds(args, *norm_linear_ref(*args, EPS))  # the bounds hold for the reference too


def test_scale_is_applied_per_row():
    """Rows of very different size: the deferred scale must be each row's own (a shared one is off by O(1))."""
    h, parts, norm_weight, weight = case(3, 256, 64, 2, seed=3)
    h = h * jnp.array([[1.0], [50.0], [0.02]], jnp.bfloat16)
    args = (h, parts * jnp.array([1.0, 50.0, 0.02])[None, :, None], norm_weight, weight)
    assert fuses(h.shape, weight.shape, ONE_SPLIT)
    assert_within_bounds(
        args, *jax.jit(lambda *a: norm_linear_pallas(*a, EPS, tuning=ONE_SPLIT, interpret=True))(*args)
    )


@pytest.mark.parametrize("rows, n, tuning", [(5, 256, ONE_SPLIT), (2, 64, NormLinearTuning(max_rows=1, linear=ONE_SPLIT.linear)),
                                             (1, 256, NormLinearTuning(linear=LinearTuning(splits=2)))])  # fmt: skip
def test_what_the_kernel_does_not_take_is_residual_norm_then_linear(rows, n, tuning):
    """More rows than max_rows, or a tiling that splits K: the two kernels, bit for bit."""
    args = case(rows, 512, n, 2)
    assert not fuses(args[0].shape, args[3].shape, tuning)
    new_h, y = norm_linear_pallas(*args, EPS, tuning=tuning, interpret=True)
    want_h, x = residual_norm_pallas(*args[:3], EPS, interpret=True)
    np.testing.assert_array_equal(np.float32(new_h), np.float32(want_h))
    np.testing.assert_array_equal(np.float32(y), np.float32(linear_pallas(x, args[3], tuning=tuning.linear,
                                                                          interpret=True)))  # fmt: skip


def test_the_4b_products_after_a_norm_fuse_at_one_row():
    """The GDN in_proj, the attention qkv and the MLP gate/up at 4B are wide enough for one K split."""
    for n in (12352, 10240, 18432):
        assert fuses((1, 2560), (n, 2560))
    assert not fuses((1, 9216), (2560, 9216))  # down: narrow, K split


def test_shapes_must_match():
    h, parts, norm_weight, weight = case(2, 256, 64, 2)
    with pytest.raises(ValueError, match="do not match h"):
        norm_linear_pallas(h, parts, norm_weight, weight[:, :128], EPS, interpret=True)


def test_lowers_to_triton_for_h200():
    """The 4B GDN in_proj at one row: one Triton call on a (N / 32,) grid."""
    args = case(1, 2560, 12352, 4)
    text = lower_for_h200(lambda *a: norm_linear_pallas(*a, EPS), *args).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert re.findall(r"grid_[xyz] = (\d+)", text) == ["386", "1", "1"]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n", [(1, 12352), (1, 18432), (4, 10240)])
def test_gpu_compiled_within_bounds(rows, n):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU; JAX runs on " + jax.default_backend())
    args = case(rows, 2560, n, 4, seed=rows)
    tuning = NormLinearTuning(max_rows=4)
    assert fuses(args[0].shape, args[3].shape, tuning)
    assert_within_bounds(args, *jax.jit(lambda *a: norm_linear_pallas(*a, EPS, tuning=tuning))(*args))
