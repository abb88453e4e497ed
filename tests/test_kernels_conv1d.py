"""Causal conv1d + SiLU: the Pallas in-pool update and prefill kernels against their references, in interpret mode
on the CPU and compiled on the GPU (`-m gpu`), with conv states carried across calls as the engine carries them.

Tolerances:
- y in fp32: both sides sum the K products in the same order in fp32 and apply the same SiLU; what is left is
  exp/division rounding inside the SiLU and, on the GPU, FMA contraction: measured <= 1e-6 on |y| <= 5 on
  the CPU. atol = rtol = 1e-6 (a wrong tap, flipped kernel or missing state row moves y by O(0.1)).
- y in bf16: the sum is rounded to bf16 before the SiLU and again after it, so a last-ulp fp32 difference
  can flip either rounding: one bf16 ulp (2^-8 relative) of the pre-SiLU value, times |silu'| <= 1.1, plus
  one of y. rtol 2^-7 with atol 2^-8 for the values where SiLU is flat and small. A flip needs the fp32
  value within an ulp or two of a bf16 rounding boundary, so flips are rare (none measured on the CPU): at
  most 1% of outputs may differ at all (skipping the rounding before the SiLU changes 25-35% of them).
- The new conv state is a copy of input values, so it must match exactly.
In-pool update: y with the same tolerances; the pool rows it writes are copies of inputs too (exact), and the rows it
does not write must come back bit-identical (it never touches them), except the trash slot that padding rows share.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels.conv1d import (
    causal_conv1d_prefill_pallas,
    causal_conv1d_prefill_ref,
    causal_conv1d_update_pool_pallas,
    causal_conv1d_update_pool_ref,
    causal_conv1d_update_ref,
)

TAPS = 4
ROUNDING_FLIPS = 0.01  # bf16: share of outputs allowed to differ at all (a rounding flip)
Y_TOL = {jnp.float32: dict(atol=1e-6, rtol=1e-6), jnp.bfloat16: dict(atol=2**-8, rtol=2**-7)}


def assert_y_close(y, expected, dtype, msg=""):
    y, expected = np.float32(y), np.float32(expected)
    np.testing.assert_allclose(y, expected, **Y_TOL[dtype], err_msg=msg)
    if dtype == jnp.bfloat16:
        assert np.mean(y != expected) <= ROUNDING_FLIPS, f"{msg}: {np.mean(y != expected):.1%} of y differ"


def exact_conv_silu(window, weight, out_len):
    """The HF rounding on the host: fp32 taps, the sum rounded to bf16, SiLU in fp32, rounded to bf16.
    The GPU tests compare against this rather than the XLA reference compiled for the GPU, because XLA
    there may drop the bf16 round trip in the middle (`xla_allow_excess_precision`), which moves about a
    quarter of the outputs by one bf16 step; the kernel keeps it, as HF does. window [rows, K-1+T, C]."""
    w = np.float32(weight)
    acc = sum(window[:, j : j + out_len] * w[:, j] for j in range(w.shape[1]))
    acc = np.float32(acc.astype(jnp.bfloat16))
    return (acc / (1.0 + np.exp(-acc))).astype(jnp.bfloat16)


def assert_state_equal(state, expected, msg=""):
    np.testing.assert_array_equal(np.float32(state), np.float32(expected), err_msg=msg)


def conv_inputs(key, lead, channels, dtype, fresh=False):
    """x [*lead, C], weight [C, K] and a conv state [rows, K-1, C] (zeros for a fresh sequence)."""
    kx, kw, ks = jax.random.split(key, 3)
    x = jax.random.normal(kx, (*lead, channels)).astype(dtype)
    weight = (0.5 * jax.random.normal(kw, (channels, TAPS))).astype(dtype)
    state = jnp.zeros((lead[0], TAPS - 1, channels), dtype)
    if not fresh:
        state = jax.random.normal(ks, state.shape).astype(dtype)
    return x, weight, state


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "seq, lengths, fresh",
    [(48, [48, 0, 13, 31], False), (48, [2, 47, 0, 16], True), (24, [24, 5, 1, 0], False), (13, [13, 3, 0, 12], False)],
    ids=["3-tiles", "fresh", "8-token-tiles", "odd-length"],
)
def test_prefill_ragged_matches_ref(seq, lengths, fresh, dtype):
    """Rows of different lengths in one call, padding rows (length 0) included; lengths that are not
    multiples of the token tile; C = 384 gives three channel blocks."""
    x, weight, state = conv_inputs(jax.random.PRNGKey(seq), (4, seq), 384, dtype, fresh)
    lengths = jnp.array(lengths, jnp.int32)
    y, new_state = causal_conv1d_prefill_pallas(x, weight, state, lengths, interpret=True)
    ref_y, ref_state = causal_conv1d_prefill_ref(x, weight, state, lengths)
    assert y.dtype == dtype and y.shape == x.shape and new_state.shape == state.shape
    assert_y_close(y, ref_y, dtype, "y")
    assert_state_equal(new_state, ref_state, "state")
    idle = np.flatnonzero(np.asarray(lengths) == 0)
    assert_state_equal(new_state[idle], state[idle], "a length-0 row keeps its state")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_prefill_then_updates_equals_one_longer_prefill(dtype):
    """Prefill 20 tokens, then decode 5 one at a time in the pool (the rows' states as slots 0-2 of a one-layer
    pool): the same outputs and state as one 25-token prefill."""
    x, weight, state = conv_inputs(jax.random.PRNGKey(3), (3, 32), 256, dtype)
    prefix, total = 20, 25
    y, conv = causal_conv1d_prefill_pallas(x, weight, state, jnp.full(3, prefix, jnp.int32), interpret=True)
    ys, pool, slots = [y[:, :prefix]], conv[None], jnp.arange(3, dtype=jnp.int32)
    update = jax.jit(lambda *a: causal_conv1d_update_pool_pallas(*a, interpret=True))
    for t in range(prefix, total):
        y_t, pool = update(x[:, t], weight, pool, jnp.int32(0), slots)
        ys.append(y_t[:, None])
    ref_y, ref_state = causal_conv1d_prefill_ref(x, weight, state, jnp.full(3, total, jnp.int32))
    assert_y_close(jnp.concatenate(ys, axis=1), ref_y[:, :total], dtype)
    assert_state_equal(pool[0], ref_state)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_chunked_ragged_prefill_equals_one_prefill(dtype):
    """Two ragged 16-token chunks per row (some rows idle in one chunk) against one prefill of each row's
    valid tokens packed together: the state handed from chunk to chunk is exactly what the conv needs."""
    x, weight, state = conv_inputs(jax.random.PRNGKey(4), (4, 32), 192, dtype)
    first, second = np.array([16, 0, 5, 11]), np.array([9, 16, 0, 3])
    y1, conv = causal_conv1d_prefill_pallas(x[:, :16], weight, state, jnp.array(first), interpret=True)
    y2, conv = causal_conv1d_prefill_pallas(x[:, 16:], weight, conv, jnp.array(second), interpret=True)
    packed = np.zeros(x.shape, np.float32)
    for row in range(4):
        packed[row, : first[row]] = x[row, : first[row]]
        packed[row, first[row] : first[row] + second[row]] = x[row, 16 : 16 + second[row]]
    ref_y, ref_state = causal_conv1d_prefill_ref(jnp.asarray(packed, dtype), weight, state, jnp.array(first + second))
    chunked = [np.float32(y)[row, :n] for row in range(4) for y, n in ((y1, first[row]), (y2, second[row]))]
    whole = [np.float32(ref_y)[row, : first[row] + second[row]] for row in range(4)]
    assert_y_close(np.concatenate(chunked), np.concatenate(whole), dtype)
    assert_state_equal(conv, ref_state)


POOL_LAYERS = 3


def pool_case(seed, batch, channels, dtype, padding):
    """A random pool [POOL_LAYERS, batch + 3, K-1, C]; `batch` distinct live slots in shuffled order, then
    `padding` padding rows at the trash slot (the last)."""
    rng = np.random.default_rng(seed)
    num_slots = batch + 3
    pool = jnp.asarray(rng.standard_normal((POOL_LAYERS, num_slots, TAPS - 1, channels)), dtype)
    slots = np.concatenate([rng.permutation(num_slots - 1)[:batch], np.full(padding, num_slots - 1)])
    return pool, jnp.asarray(slots, jnp.int32), num_slots - 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch, channels, padding", [(1, 96, 0), (3, 384, 2), (5, 1024, 1)])
def test_update_pool_matches_ref_over_steps(batch, channels, padding, dtype):
    """Updates at layers 1, 2, 2, 0, kernel (jitted, `layer` traced) and reference each carrying their own pool:
    y and the written rows as the reference; every row not written bit-identical to before."""
    pool, slots, trash = pool_case(batch, batch, channels, dtype, padding)
    _, weight, _ = conv_inputs(jax.random.PRNGKey(batch), (1,), channels, dtype)
    kernel_step = jax.jit(lambda *a: causal_conv1d_update_pool_pallas(*a, interpret=True))
    kernel_pool = ref_pool = pool
    for step, layer in enumerate([1, 2, 2, 0]):
        x = jax.random.normal(jax.random.PRNGKey(10 + step), (batch + padding, channels)).astype(dtype)
        y, new_pool = kernel_step(x, weight, kernel_pool, jnp.int32(layer), slots)
        ref_y, ref_pool = causal_conv1d_update_pool_ref(x, weight, ref_pool, jnp.int32(layer), slots)
        assert y.dtype == dtype and new_pool.shape == pool.shape and new_pool.dtype == pool.dtype
        assert_y_close(y[:batch], ref_y[:batch], dtype, f"y, step {step}")
        live = np.ones(pool.shape[:2], bool)
        live[:, trash] = False
        assert_state_equal(np.asarray(new_pool)[live], np.asarray(ref_pool)[live], f"pool, step {step}")
        untouched = live.copy()
        untouched[layer, np.asarray(slots)] = False
        assert_state_equal(np.asarray(new_pool)[untouched], np.asarray(kernel_pool)[untouched], f"step {step}")
        kernel_pool = new_pool


def test_update_pool_ref_is_gather_update_scatter():
    """`causal_conv1d_update_pool_ref` is the plain update on pool[layer][slots] written back to those rows."""
    pool, slots, _ = pool_case(7, 4, 64, jnp.float32, 0)
    x, weight, _ = conv_inputs(jax.random.PRNGKey(7), (4,), 64, jnp.float32)
    y, new_pool = causal_conv1d_update_pool_ref(x, weight, pool, jnp.int32(2), slots)
    expected_y, rows = causal_conv1d_update_ref(x, weight, pool[2][slots])
    expected_pool = np.array(pool)
    expected_pool[2, np.asarray(slots)] = np.asarray(rows)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected_y))
    np.testing.assert_array_equal(np.asarray(new_pool), expected_pool)


def test_update_reads_the_first_rows_of_a_taller_input():
    """In a step with prefill rows the model hands the update the whole product, decode rows first: kernel and
    reference read its first B = slots.shape[0] rows (3 more rows of NaN here change nothing, bit for bit) and give
    y [B, C]."""
    pool, slots, _ = pool_case(5, 4, 64, jnp.bfloat16, 0)
    x, weight, _ = conv_inputs(jax.random.PRNGKey(5), (4,), 64, jnp.bfloat16)
    tall = jnp.concatenate([x, jnp.full((3, 64), jnp.nan, x.dtype)])
    for fn in (causal_conv1d_update_pool_ref, lambda *a: causal_conv1d_update_pool_pallas(*a, interpret=True)):
        for got, want in zip(fn(tall, weight, pool, jnp.int32(1), slots), fn(x, weight, pool, jnp.int32(1), slots),
                             strict=True):  # fmt: skip
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_both_kernels_read_the_first_columns_of_a_wider_input():
    """The model hands the conv its input projection's whole product (the conv's C columns, then z, b and a): the
    kernels and the references on x with 200 more columns of garbage (NaN) give what they give on x itself, bit for
    bit, with outputs C wide."""
    channels, seq = 384, 24
    x, weight, state = conv_inputs(jax.random.PRNGKey(7), (2, seq), channels, jnp.bfloat16)
    wide = jnp.concatenate([x, jnp.full((2, seq, 200), jnp.nan, x.dtype)], axis=-1)
    lengths = jnp.array([seq, 9], jnp.int32)
    for fn in (causal_conv1d_prefill_ref, lambda *a: causal_conv1d_prefill_pallas(*a, interpret=True)):
        for got, want in zip(fn(wide, weight, state, lengths), fn(x, weight, state, lengths), strict=True):
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.float32(got), np.float32(want))
    pool, slots, _ = pool_case(3, 2, channels, jnp.bfloat16, padding=1)
    for fn in (causal_conv1d_update_pool_ref, lambda *a: causal_conv1d_update_pool_pallas(*a, interpret=True)):
        narrow = fn(x[:, 0][jnp.array([0, 1, 1])], weight, pool, jnp.int32(1), slots)
        got = fn(wide[:, 0][jnp.array([0, 1, 1])], weight, pool, jnp.int32(1), slots)
        for g, w in zip(got, narrow, strict=True):
            assert g.shape == w.shape
            np.testing.assert_array_equal(np.float32(g), np.float32(w))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_update_pool_lowers_to_triton_for_h200():
    """4B shapes at batch 64 over a [24, 257, 3, 8192] bf16 pool (given abstractly): it lowers, the pool (operand
    4) is aliased to the new pool (result 1), so XLA updates the rows in place, and the grid is (B, C/512)."""
    spec = jax.ShapeDtypeStruct
    text = lower_for_h200(
        causal_conv1d_update_pool_pallas, spec((64, 8192), jnp.bfloat16), spec((8192, TAPS), jnp.bfloat16),
        spec((24, 257, TAPS - 1, 8192), jnp.bfloat16), spec((), jnp.int32), spec((64,), jnp.int32),
    ).as_text()  # fmt: skip
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 4" in text
    assert re.findall(r"grid_[xyz] = (\d+)", text) == ["64", "16", "1"]


def test_update_pool_wrapper_holds_no_nested_jit():
    """Only lax primitives around the pallas_call: the model may call it inside stream-annotated regions."""
    spec = jax.ShapeDtypeStruct
    jaxpr = jax.make_jaxpr(lambda *a: causal_conv1d_update_pool_pallas(*a, interpret=True))(
        spec((2, 64), jnp.float32), spec((64, TAPS), jnp.float32), spec((2, 4, TAPS - 1, 64), jnp.float32),
        spec((), jnp.int32), spec((2,), jnp.int32),
    )  # fmt: skip
    names = [eqn.primitive.name for eqn in jaxpr.eqns]
    assert "pallas_call" in names and not {"jit", "pjit", "closed_call"} & set(names), names


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_prefill_lowers_to_triton_for_h200():
    """4B shapes (C = 8192, K = 4) through the Triton lowering: tensor sizes are powers of two, every
    primitive has a rule, and the grid is (P, T/16, C/256)."""
    spec = jax.ShapeDtypeStruct
    weight = spec((8192, TAPS), jnp.bfloat16)
    prefill = lower_for_h200(
        causal_conv1d_prefill_pallas,
        spec((4, 512, 8192), jnp.bfloat16),
        weight,
        spec((4, 3, 8192), jnp.bfloat16),
        spec((4,), jnp.int32),
    ).as_text()
    assert re.findall(r"grid_[xyz] = (\d+)", prefill) == ["4", "32", "32"]


def test_host_math_agrees_with_the_cpu_reference():
    """The GPU tests' oracle is itself checked: on the CPU, XLA keeps the bf16 round trip of the reference."""
    x, weight, state = conv_inputs(jax.random.PRNGKey(3), (2, 64), 512, jnp.bfloat16)
    ref_y, _ = causal_conv1d_prefill_ref(x, weight, state, jnp.array([64, 10], jnp.int32))
    window = np.concatenate([np.float32(state), np.float32(x)], axis=1)
    assert_y_close(exact_conv_silu(window, weight, 64), ref_y, jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_prefill_matches_host_math_at_4b_shapes():
    x, weight, state = conv_inputs(jax.random.PRNGKey(0), (4, 512), 8192, jnp.bfloat16)
    lengths = jnp.array([512, 0, 77, 301], jnp.int32)
    y, conv = jax.jit(causal_conv1d_prefill_pallas)(x, weight, state, lengths)
    _, ref_conv = jax.jit(causal_conv1d_prefill_ref)(x, weight, state, lengths)
    window = np.concatenate([np.float32(state), np.float32(x)], axis=1)
    assert_y_close(y, exact_conv_silu(window, weight, x.shape[1]), jnp.bfloat16)
    assert_state_equal(conv, ref_conv)


@pytest.mark.gpu
def test_gpu_update_pool_matches_host_math_at_4b_shapes():
    """Batch 64 over a [24, 67, 3, 8192] pool, the pool donated (in place): y against the host math, the pool
    against the reference's, over three steps at different layers."""
    pool, slots, _ = pool_case(0, 64, 8192, jnp.bfloat16, padding=0)
    pool = jnp.concatenate([pool] * 8)  # 24 layers
    _, weight, _ = conv_inputs(jax.random.PRNGKey(0), (1,), 8192, jnp.bfloat16)
    step = jax.jit(causal_conv1d_update_pool_pallas, donate_argnums=2)
    ref_step = jax.jit(causal_conv1d_update_pool_ref)
    ref_pool = pool + 0  # a copy: `pool` is donated
    for i, layer in enumerate([5, 23, 5]):
        x = jax.random.normal(jax.random.PRNGKey(i + 1), (64, 8192)).astype(jnp.bfloat16)
        window = np.concatenate([np.float32(ref_pool[layer][slots]), np.float32(x)[:, None]], axis=1)
        y, pool = step(x, weight, pool, jnp.int32(layer), slots)
        _, ref_pool = ref_step(x, weight, ref_pool, jnp.int32(layer), slots)
        assert_y_close(y, exact_conv_silu(window, weight, 1)[:, 0], jnp.bfloat16)
        assert_state_equal(pool, ref_pool)
