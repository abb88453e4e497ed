"""The decode weight-product kernel (`kernels.linear`) against its reference and against exact products: in
interpret mode on the CPU, lowered for the H200, and compiled on the GPU (`-m gpu`) at 4B shapes.

Tolerances, from the summation-error bound: both sides sum K fp32 products of the same operands, in different
orders (blocks of block_k, splits added last), so each differs from the exact sum by at most
gamma_K * sum_k |x_k w_k| with gamma_K ~ K * 2^-24 (the standard worst-case bound for recursive summation;
tensor-core and blocked sums are tighter). fp32 inputs: |kernel - exact| <= K * 2^-24 * (|x| @ |w|^T).
bf16 outputs add one rounding to bf16: 2^-8 of |exact| (half an ulp each side of a rounding boundary, so
kernel and reference may sit one bf16 step apart). A dropped K split, block or wrong column moves outputs by
O(|x| @ |w|^T), orders of magnitude above these bounds.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels.linear import LinearTuning, default_splits, linear_pallas, linear_ref

MAX_ROWS = LinearTuning().max_rows


def operands(m, n, k, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m, k)).astype(dtype), jax.random.normal(kw, (n, k)).astype(dtype)


def assert_within_summation_bound(y, x, w, slack=0.0):
    """y against the exact product (float64 on the host), within the bound of the module docstring (+ slack)."""
    x64, w64 = np.float64(np.float32(x)), np.float64(np.float32(w))
    exact, magnitude = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    k = x.shape[-1]
    bound = k * 2.0**-24 * magnitude + slack
    if y.dtype == jnp.bfloat16:
        bound = bound + 2.0**-8 * np.abs(exact)
    err = np.abs(np.float64(np.float32(y)) - exact)
    assert np.all(err <= bound), f"max err {err.max():.3g}, bound there {bound.flat[np.argmax(err - bound)]:.3g}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m, n, k, splits", [(1, 256, 1024, None), (5, 128, 2048, 2), (16, 64, 512, 1),
                                             (MAX_ROWS, 192, 768, 3), (3, 32, 64, None)])  # fmt: skip
def test_matches_exact_product_within_summation_bound(m, n, k, splits, dtype):
    """Rows 1..MAX_ROWS (padded to tensor-core tiles inside), K split or not, N and K not powers of two."""
    x, w = operands(m, n, k, dtype)
    y = linear_pallas(x, w, tuning=LinearTuning(splits=splits), interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_within_summation_bound(y, x, w)
    assert_within_summation_bound(linear_ref(x, w), x, w)  # the bound holds for the reference too


def test_x_must_match_the_weights_k():
    x, w = operands(2, 64, 256, jnp.float32)
    with pytest.raises(ValueError, match="does not match w's K=256"):
        linear_pallas(x[:, :128], w, interpret=True)


def test_leading_dims_are_flattened_and_restored():
    x, w = operands(6, 128, 256, jnp.float32)
    y = linear_pallas(x.reshape(2, 3, 256), w, interpret=True)
    assert y.shape == (2, 3, 128)
    np.testing.assert_array_equal(y.reshape(6, 128), linear_pallas(x, w, interpret=True))


@pytest.mark.parametrize("m, n, k", [(MAX_ROWS + 1, 128, 256), (4, 40, 256), (4, 64, 200)])
def test_what_the_kernel_does_not_take_is_the_reference_exactly(m, n, k):
    """More rows than MAX_ROWS (prefill), or N / K not multiples of 16: XLA's product, bit for bit."""
    x, w = operands(m, n, k, jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(linear_pallas(x, w, interpret=True)), np.float32(linear_ref(x, w)))


def test_tunings_that_cannot_divide_are_refused():
    """A benchmark's tiling that does not fit is refused, never silently replaced by XLA's product."""
    x, w = operands(1, 64, 512, jnp.float32)
    with pytest.raises(ValueError, match="splits=3"):
        linear_pallas(x, w, tuning=LinearTuning(splits=3), interpret=True)
    for name, value in (("block_n", 48), ("block_k", 8)):
        with pytest.raises(ValueError, match=f"{name} must be a power of two"):
            LinearTuning(**{name: value})


def test_a_smaller_max_rows_sends_more_rows_to_the_reference():
    x, w = operands(8, 64, 256, jnp.bfloat16)
    small = linear_pallas(x, w, tuning=LinearTuning(max_rows=4), interpret=True)
    np.testing.assert_array_equal(np.float32(small), np.float32(linear_ref(x, w)))


def test_default_splits_reach_enough_programs_on_narrow_weights():
    """4B: N = 2560 (out_proj, down) gets its K split; wide weights (gate/up, 18432) not at all; every split keeps
    >= 4 block_k steps and divides K's steps (the target, 2 programs an SM, at the 132 SMs interpret mode assumes)."""
    assert default_splits(2560, 9216, 64, 256) == 9  # 36 steps: 40 x 9 programs
    assert default_splits(2560, 4096, 64, 256) == 4  # 16 steps
    assert default_splits(18432, 2560, 64, 256) == 1  # 288 column blocks >= 264
    assert default_splits(18432, 2560, 64, 256, LinearTuning(programs_per_sm=4)) == 2  # 10 steps: 288 x 2
    assert default_splits(64, 512, 64, 256) == 1  # 2 steps: no split leaves 4
    assert default_splits(2560, 9216, 64, 256, LinearTuning(programs_per_sm=1)) == 4  # 160 programs >= 132


def test_lowers_to_triton_for_h200():
    """4B gate/up and down products at batch 1 and MAX_ROWS (32): Triton accepts the default tiles (block_n 32, block_k 128);
    the grids are (N/32, splits)."""
    spec = jax.ShapeDtypeStruct
    grids = []
    for m, n, k in [(1, 18432, 2560), (MAX_ROWS, 2560, 9216)]:
        text = lower_for_h200(linear_pallas, spec((m, k), jnp.bfloat16), spec((n, k), jnp.bfloat16)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        grids.append(re.findall(r"grid_[xyz] = (\d+)", text))
    assert grids == [["576", "1", "1"], ["80", "4", "1"]]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 18432, 2560), (16, 2560, 9216), (32, 2560, 4096), (32, 8192, 2560),
                                     (1, 32, 2560)])  # fmt: skip
def test_gpu_matches_exact_product_at_4b_shapes(m, n, k):
    x, w = operands(m, n, k, jnp.bfloat16, seed=m)
    y = jax.jit(linear_pallas)(x, w)
    assert_within_summation_bound(y, x, w)
