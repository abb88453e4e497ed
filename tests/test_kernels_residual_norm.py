"""The residual add + RMSNorm kernel (`kernels.residual_norm`) against its reference: in interpret mode on the CPU,
lowered for the H200, and compiled on the GPU (`-m gpu`) at the 4B width.

Tolerances: both sides compute the same fp32 expressions on the same bf16 values, and differ only in the order of
the partials' sum (S fp32 terms) and of the sum of squares (K terms): relative differences of a few fp32 ulps
before each rounding to bf16. A value that close to a rounding boundary can round the other way, one bf16 step
(at most 2^-7 relative). So delta may move one step, and h' = round(h + delta) by that plus its own step:
|dh'| <= 2^-7 (|delta| + |h'|), which under cancellation (h ~ -delta) is far more than a step of h' itself. x
scales h' by s (1 + w), s = rsqrt(mean(h'^2) + eps): |dx| <= 2^-7 |x| + |dh'| s |1 + w|. Such flips are rare
(under 1% of values; everything else is exact), and a missing partial, a wrong row or the weight without its +1
moves values by O(1) relative, far outside these bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels.residual_norm import residual_delta, residual_norm_pallas, residual_norm_ref, rms_norm

STEP = 2.0**-7  # one bf16 step, relative, at most
EPS = 1e-6


def case(rows, width, splits, parts_dtype, seed=0):
    kh, kp, kw = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (rows, width)).astype(jnp.bfloat16)
    parts = (jax.random.normal(kp, (splits, rows, width)) / splits).astype(parts_dtype)
    weight = (0.1 * jax.random.normal(kw, (width,))).astype(jnp.bfloat16)
    return h, parts, weight


def assert_matches_ref(h, parts, weight, new_h, x):
    """The kernel's (new_h, x) against the reference's, within the module docstring's bounds."""
    ref_h, ref_x = (np.float64(np.float32(a)) for a in residual_norm_ref(h, parts, weight, EPS))
    delta = np.float64(np.float32(residual_delta(parts, jnp.bfloat16)))
    scale = 1.0 / np.sqrt(np.mean(ref_h**2, axis=-1, keepdims=True) + EPS)
    tol_h = STEP * (np.abs(delta) + np.abs(ref_h)) + 1e-6
    tol_x = STEP * np.abs(ref_x) + tol_h * scale * np.abs(1.0 + np.float64(np.float32(weight))) + 1e-6
    for name, got, want, tol in (("h", new_h, ref_h, tol_h), ("x", x, ref_x, tol_x)):
        err = np.abs(np.float64(np.float32(got)) - want)
        assert np.all(err <= tol), (
            f"{name}: max err {err.max():.3g} where the bound is {tol.flat[np.argmax(err - tol)]:.3g}"
        )
        assert np.mean(err > 0) < 0.01, f"{name}: {np.mean(err > 0):.1%} of values differ (rounding flips only)"


@pytest.mark.parametrize(
    "rows, width, splits, parts_dtype",
    [(1, 2560, 4, jnp.float32), (3, 2560, 1, jnp.bfloat16), (5, 256, 3, jnp.float32), (2, 96, 2, jnp.float32)],
    ids=["4b-width-split", "one-bf16-part", "power-of-two-width", "narrow-masked"],
)
def test_matches_ref(rows, width, splits, parts_dtype):
    h, parts, weight = case(rows, width, splits, parts_dtype)
    new_h, x = jax.jit(lambda *a: residual_norm_pallas(*a, EPS, interpret=True))(h, parts, weight)
    assert new_h.dtype == x.dtype == jnp.bfloat16 and new_h.shape == x.shape == h.shape
    assert_matches_ref(h, parts, weight, new_h, x)


def test_ref_is_add_then_norm():
    """The reference is the model's old two steps exactly: h + round(sum of parts), then `rms_norm` of that."""
    h, parts, weight = case(4, 64, 3, jnp.float32, seed=1)
    new_h, x = residual_norm_ref(h, parts, weight, EPS)
    want_h = h + parts.sum(axis=0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(new_h), np.float32(want_h))
    np.testing.assert_array_equal(np.float32(x), np.float32(rms_norm(want_h, weight, EPS)))
    single = parts[:1].astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(residual_delta(single, jnp.bfloat16)), np.float32(single[0]))


def test_shapes_must_match():
    h, parts, weight = case(2, 64, 2, jnp.float32)
    with pytest.raises(ValueError, match="do not match h"):
        residual_norm_pallas(h, parts[:, :1], weight, EPS, interpret=True)


def test_lowers_to_triton_for_h200():
    """The 4B width (2560, not a power of two) lowers: its loads are 4096 masked lanes."""
    h, parts, weight = case(1, 2560, 4, jnp.float32)
    text = lower_for_h200(lambda *a: residual_norm_pallas(*a, EPS), h, parts, weight).as_text()
    assert "residual_norm" in text


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_gpu_compiled_matches_ref(rows):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU; JAX runs on " + jax.default_backend())
    h, parts, weight = case(rows, 2560, 4, jnp.float32, seed=rows)
    new_h, x = jax.jit(lambda *a: residual_norm_pallas(*a, EPS))(h, parts, weight)
    assert_matches_ref(h, parts, weight, new_h, x)
