"""The MLP activation + down product kernel (`kernels.glu_linear`) against exact arithmetic and its reference: in
interpret mode on the CPU, lowered for the H200, and compiled on the GPU (`-m gpu`) at the 4B shape.

Tolerances. The partial sums, added up, are held to the exact product of the reference's operand,
y* = silu_mul(gate, up) @ W^T in float64:
- the K fp32 products summed in some order: K 2^-24 (|x| @ |W|^T) (linear's test);
- silu computed by Triton instead of XLA can differ by a few fp32 ulps, which flips the rounding of an operand
  element to bf16 now and then: one step, at most 2^-7 of it, so at most 2^-7 (|x| @ |W|^T) if every element
  flipped (a bound, not the typical error);
- one part in bf16 (no K split): its rounding, 2^-8 |y*|.
Dropping a split, a block, a half or the activation moves y by O(|x| @ |W|^T), far outside.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels.glu_linear import fuses, glu_linear_parts_pallas, glu_linear_parts_ref, silu_mul
from qwen35_jax.kernels.linear import LinearTuning, linear_parts_pallas

STEP = 2.0**-7


def case(rows, inner, n, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    gate_up = (2 * jax.random.normal(kx, (rows, 2 * inner))).astype(jnp.bfloat16)
    weight = (jax.random.normal(kw, (n, inner)) / np.sqrt(inner)).astype(jnp.bfloat16)
    return gate_up, weight


def assert_within_bounds(gate_up, weight, parts):
    gate, up = jnp.split(gate_up, 2, axis=-1)
    x = np.float64(np.float32(silu_mul(gate, up)))
    w = np.float64(np.float32(weight))
    exact, magnitude = x @ w.T, np.abs(x) @ np.abs(w).T
    bound = (w.shape[-1] * 2.0**-24 + STEP) * magnitude + 1e-6
    if parts.shape[0] == 1 and parts.dtype == jnp.bfloat16:
        bound = bound + 2.0**-8 * np.abs(exact)
    got = np.float64(np.float32(parts)).sum(axis=0)
    err = np.abs(got - exact)
    assert np.all(err <= bound), f"max err {err.max():.3g}, bound there {bound.flat[np.argmax(err - bound)]:.3g}"


@pytest.mark.parametrize("rows, inner, n, splits", [(1, 1024, 256, 4), (1, 512, 64, 1), (3, 256, 128, 2)],
                         ids=["split", "one-part", "three-rows"])  # fmt: skip
def test_fused_kernel_within_bounds(rows, inner, n, splits):
    gate_up, weight = case(rows, inner, n)
    tuning = LinearTuning(splits=splits)
    assert fuses(gate_up.shape, weight.shape, tuning, max_rows=4)
    run = jax.jit(lambda g, w: glu_linear_parts_pallas(g, w, tuning=tuning, max_rows=4, interpret=True))
    parts = run(gate_up, weight)
    assert parts.shape == (splits, rows, n)
    assert parts.dtype == (jnp.float32 if splits > 1 else jnp.bfloat16)
    assert_within_bounds(gate_up, weight, parts)
    assert_within_bounds(gate_up, weight, glu_linear_parts_ref(gate_up, weight))  # the bound holds for the ref


def test_the_halves_are_gate_then_up():
    """silu applies to the first half only: swapped halves give another product, far outside the bound."""
    gate_up, weight = case(1, 256, 64, seed=2)
    swapped = jnp.concatenate(jnp.split(gate_up, 2, axis=-1)[::-1], axis=-1)
    parts = glu_linear_parts_pallas(swapped, weight, tuning=LinearTuning(splits=2), interpret=True)
    with pytest.raises(AssertionError, match="max err"):
        assert_within_bounds(gate_up, weight, parts)


def test_more_rows_than_it_takes_are_the_activation_then_linear_parts():
    """Past FUSED_MAX_ROWS: XLA's activation and `linear_parts_pallas`, bit for bit."""
    gate_up, weight = case(3, 256, 128)
    assert not fuses(gate_up.shape, weight.shape)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    np.testing.assert_array_equal(np.float32(glu_linear_parts_pallas(gate_up, weight, interpret=True)),
                                  np.float32(linear_parts_pallas(silu_mul(gate, up), weight, interpret=True)))  # fmt: skip


def test_gate_up_must_be_twice_the_weights_k():
    gate_up, weight = case(1, 256, 64)
    with pytest.raises(ValueError, match="not \\[rows, 2 x the weight's K=128\\]"):
        glu_linear_parts_pallas(gate_up, weight[:, :128], interpret=True)


def test_lowers_to_triton_for_h200():
    """The 4B down product at one row: one Triton call on linear's grid (N / 32, 4 K splits)."""
    gate_up, weight = case(1, 9216, 2560)
    text = lower_for_h200(glu_linear_parts_pallas, gate_up, weight).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert re.findall(r"grid_[xyz] = (\d+)", text) == ["80", "4", "1"]


@pytest.mark.gpu
def test_gpu_compiled_within_bounds_at_4b():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU; JAX runs on " + jax.default_backend())
    gate_up, weight = case(1, 9216, 2560, seed=1)
    assert fuses(gate_up.shape, weight.shape)
    assert_within_bounds(gate_up, weight, jax.jit(glu_linear_parts_pallas)(gate_up, weight))
