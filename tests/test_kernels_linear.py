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

from qwen35_jax.kernels.linear import (
    LinearTuning,
    default_splits,
    linear_pallas,
    linear_parts_pallas,
    linear_ref,
    mlp_down_parts_pallas,
    mlp_down_parts_ref,
    silu_mul,
)

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


def gate_up_operands(m, n, k, dtype, seed=0):
    """A gate/up product [m, 2k] (gate, then up) at the scale a layer gives it, and a down weight [n, k]."""
    kp, kw = jax.random.split(jax.random.key(seed))
    return (2 * jax.random.normal(kp, (m, 2 * k))).astype(dtype), jax.random.normal(kw, (n, k)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m, n, k, splits", [(1, 256, 1024, None), (5, 128, 2048, 2), (MAX_ROWS, 192, 768, 3)])
def test_the_down_projection_makes_the_activation_it_reads(m, n, k, splits, dtype):
    """The fused down projection equals the product kernel over silu_mul(gate, up) bit for bit (interpret mode
    computes both operands with the same elementwise ops, and the sums walk the same blocks), so the activation
    is read from the right columns: gate's from 0, up's from K."""
    product, w = gate_up_operands(m, n, k, dtype)
    tuning = LinearTuning(splits=splits)
    fused = mlp_down_parts_pallas(product, w, tuning=tuning, interpret=True)
    gate, up = product[:, :k], product[:, k:]
    apart = linear_parts_pallas(silu_mul(gate, up), w, tuning=tuning, interpret=True)
    assert fused.shape == apart.shape and fused.dtype == apart.dtype
    np.testing.assert_array_equal(np.float32(fused), np.float32(apart))
    assert_within_summation_bound(fused.sum(axis=0).astype(dtype), silu_mul(gate, up), w)
    swapped = silu_mul(up, gate)  # a kernel reading the halves the other way round is far off
    assert np.abs(np.float32(fused.sum(axis=0)) - np.float32(silu_mul(gate, up) @ w.T)).max() < np.abs(
        np.float32(swapped @ w.T) - np.float32(silu_mul(gate, up) @ w.T)).max() / 100  # fmt: skip


def test_the_down_projection_beyond_the_kernel_is_the_reference_exactly():
    """More rows than MAX_ROWS (prefill chunks): XLA's activation and product, bit for bit."""
    product, w = gate_up_operands(MAX_ROWS + 3, 128, 256, jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(mlp_down_parts_pallas(product, w, interpret=True)),
                                  np.float32(mlp_down_parts_ref(product, w)))  # fmt: skip


def test_the_down_projection_needs_gate_and_up_of_its_weights_k():
    product, w = gate_up_operands(2, 64, 256, jnp.float32)
    with pytest.raises(ValueError, match="not twice w's K=256"):
        mlp_down_parts_pallas(product[:, :300], w, interpret=True)


def test_the_down_projection_lowers_to_one_triton_call_for_h200():
    """4B's down projection at batch 1: one kernel (no activation fusion before it), the product's grid."""
    spec = jax.ShapeDtypeStruct
    text = lower_for_h200(mlp_down_parts_pallas, spec((1, 2 * 9216), jnp.bfloat16),
                          spec((2560, 9216), jnp.bfloat16)).as_text()  # fmt: skip
    assert text.count("__gpu$xla.gpu.triton") == 1 and "logistic" not in text.split("__gpu$xla.gpu.triton")[0]
    assert re.findall(r"grid_[xyz] = (\d+)", text) == ["80", "4", "1"]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 18432, 2560), (16, 2560, 9216), (32, 2560, 4096), (32, 8192, 2560),
                                     (1, 32, 2560)])  # fmt: skip
def test_gpu_matches_exact_product_at_4b_shapes(m, n, k):
    x, w = operands(m, n, k, jnp.bfloat16, seed=m)
    y = jax.jit(linear_pallas)(x, w)
    assert_within_summation_bound(y, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, MAX_ROWS])
def test_gpu_down_projection_matches_the_product_of_its_activation_at_4b_shapes(m):
    """On the GPU the activation is Triton's silu inside the kernel against XLA's outside it: an operand element
    may sit one bf16 step (2^-8 relative) apart, so the bound adds 2^-8 of |activation| @ |w|^T."""
    product, w = gate_up_operands(m, 2560, 9216, jnp.bfloat16, seed=m)
    y = jax.jit(mlp_down_parts_pallas)(product, w).sum(axis=0).astype(jnp.bfloat16)
    act = jax.jit(lambda p: silu_mul(p[:, :9216], p[:, 9216:]))(product)
    slack = 2.0**-8 * (np.abs(np.float64(np.float32(act))) @ np.abs(np.float64(np.float32(w))).T)
    assert_within_summation_bound(y, act, w, slack=slack)
