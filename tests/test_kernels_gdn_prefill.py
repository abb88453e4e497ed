"""The Pallas GDN chunked prefill against the pure-JAX reference (CPU: Pallas interpret mode) and against the
token-by-token recurrence of the decode reference.

Tolerances, as max |error| / max |reference| over a tensor:
- fp32 inputs: 2e-5. Both sides are fp32 end to end (the kernel's matmuls use exact fp32 operands); what is
  left is summation order and the blocked triangular solve against `solve_triangular`: measured <= 4e-7 here.
- bf16 inputs: 2.5e-2 for outputs, 1.5e-2 for states. The reference runs in fp32 on the same bf16 inputs; the
  kernel rounds the `_coarse` products' operands (and W) to bf16 and the output itself is bf16 (0.4% at its
  largest values). The bound holds even with every matmul operand rounded to bf16 (2^-9 = 0.2% each, several
  chained per chunk, as flash-linear-attention does: measured <= 0.8% (outputs) and <= 0.6% (states)); the
  kernel's TF32 operands are closer, which `test_tf32_dots_are_as_close_to_fp32_as_the_reference` checks. A
  wrong gate, mask, decay or state hand-off moves these by tens of percent.
Outputs are compared at valid tokens only; at padding tokens the kernel writes zeros (checked).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels.gdn_decode import gdn_decode_ref
from qwen35_jax.kernels.gdn_prefill import (
    _unit_lower_inverses,
    _unit_lower_inverses_doubling,
    gdn_chunked_prefill_packed_pallas,
    gdn_chunked_prefill_packed_ref,
    gdn_chunked_prefill_pallas,
    gdn_chunked_prefill_ref,
    gdn_prefill_tuning,
)

TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (2.5e-2, 1.5e-2)}  # (outputs, states)


def make_inputs(seed, rows, seq, nk, nv, dk, dv, dtype):
    """Random GDN inputs shaped like the model's: g = -exp(A_log) softplus(a + dt_bias) <= 0, beta = sigmoid(b)."""
    keys = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(keys[0], (rows, seq, nk, dk)).astype(dtype)
    k = jax.random.normal(keys[1], (rows, seq, nk, dk)).astype(dtype)
    v = jax.random.normal(keys[2], (rows, seq, nv, dv)).astype(dtype)
    a_log = jnp.linspace(-4.0, 1.0, nv)  # slow to fast decaying heads
    g = -jnp.exp(a_log) * jax.nn.softplus(jax.random.normal(keys[3], (rows, seq, nv)) - 1.0)
    beta = jax.nn.sigmoid(2.0 * jax.random.normal(keys[4], (rows, seq, nv))).astype(dtype)
    state = 0.3 * jax.random.normal(keys[5], (rows, nv, dk, dv))
    return q, k, v, g, beta, state


def valid_mask(lengths, seq):
    return np.arange(seq)[None, :] < np.asarray(lengths)[:, None]  # [P, T]


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-6))


def assert_matches(out, state, out_ref, state_ref, lengths, dtype):
    out_tol, state_tol = TOLERANCES[jnp.dtype(dtype).name]
    valid = valid_mask(lengths, out.shape[1])[..., None, None]
    out, out_ref = np.asarray(out, np.float32), np.asarray(out_ref, np.float32)
    assert relative_error(np.where(valid, out, 0.0), np.where(valid, out_ref, 0.0)) <= out_tol
    assert not np.any(np.where(valid, 0.0, out)), "padding tokens must get zero output"
    assert relative_error(state, state_ref) <= state_tol


def tuned(v, **tiles):
    """The measured tiles for v's rows and heads with `tiles` replaced, or None (the kernel's default) without any."""
    rows, _, heads, dv = v.shape
    return dataclasses.replace(gdn_prefill_tuning(rows, heads, dv), **tiles) if tiles else None


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def pallas(q, k, v, g, beta, state, lengths, interpret=True, tuning=None):
    return gdn_chunked_prefill_pallas(q, k, v, g, beta, state, lengths, interpret=interpret, tuning=tuning)


reference = jax.jit(gdn_chunked_prefill_ref)


@pytest.mark.parametrize(
    "seq, nk, nv, dk, dv, dtype, block_v",
    [
        (192, 2, 4, 128, 128, "float32", None),  # real head size, value/key ratio 2
        (192, 2, 4, 128, 128, "bfloat16", 64),
        (80, 2, 2, 32, 16, "float32", None),  # ratio 1; T a multiple of 16, not of 64
        (16, 1, 1, 16, 32, "bfloat16", None),  # the smallest chunk bucket
    ],
)
def test_matches_reference_on_ragged_rows(seq, nk, nv, dk, dv, dtype, block_v):
    """Rows of different lengths in one call (full, not a multiple of 64, empty, one token), each from its own state."""
    inputs = make_inputs(0, 4, seq, nk, nv, dk, dv, jnp.dtype(dtype))
    lengths = jnp.array([seq, seq - 13, 0, 1], jnp.int32)
    tiles = {"block_v": block_v} if block_v else {}
    out, state = pallas(*inputs, lengths, tuning=tuned(inputs[2], **tiles))
    out_ref, state_ref = reference(*inputs, lengths)
    assert out.dtype == out_ref.dtype and state.dtype == jnp.float32
    assert_matches(out, state, out_ref, state_ref, lengths, dtype)
    np.testing.assert_array_equal(state[2], inputs[-1][2])  # the empty row keeps its state bit for bit


def test_tf32_dots_are_as_close_to_fp32_as_the_reference():
    """On bf16 inputs the kernel keeps the products the output is sensitive to in fp32 operands (exact fp32 in
    interpret mode; TF32 on the GPU). Against the fp32 truth (the reference on the same inputs in fp32, fp32 out), its
    output error is within 1.25x of the reference's own (bf16 output rounding alone: 0.34% here; tf32 measured
    1.04x, the bf16 form 1.64x) and its state error <= 2e-3 (tf32 measured 1.3e-3, bf16 4.8e-3), so this fails if
    the sensitive operands are rounded to bf16."""
    q, k, v, g, beta, state = make_inputs(0, 2, 192, 2, 4, 128, 128, jnp.bfloat16)
    lengths = jnp.array([192, 101])
    valid = valid_mask(lengths, 192)[..., None, None]
    out_ref, _ = reference(q, k, v, g, beta, state, lengths)
    truth, truth_state = reference(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)), state, lengths)
    out, new_state = pallas(q, k, v, g, beta, state, lengths)

    def error(x):
        return relative_error(np.where(valid, x, 0.0), np.where(valid, truth, 0.0))

    assert error(out) <= 1.25 * error(out_ref)
    assert relative_error(new_state, truth_state) <= 2e-3


def test_padding_tokens_are_inert():
    """Garbage (NaN) at padding tokens changes neither the states nor the valid outputs; padding rows keep their
    state bit for bit."""
    seq = 160  # the shapes of test_state_carries_across_calls: one compile for both
    q, k, v, g, beta, state = make_inputs(1, 3, seq, 1, 2, 16, 16, jnp.float32)
    lengths = jnp.array([100, 0, 64], jnp.int32)
    padding = ~valid_mask(lengths, seq)
    poisoned = [jnp.where(padding.reshape(padding.shape + (1,) * (x.ndim - 2)), jnp.nan, x) for x in (q, k, v, g, beta)]
    out, new_state = pallas(*poisoned, state, lengths)
    out_ref, state_ref = reference(q, k, v, g, beta, state, lengths)
    assert_matches(out, new_state, out_ref, state_ref, lengths, jnp.float32)
    np.testing.assert_array_equal(new_state[1], state[1])


def recurrence(q, k, v, g, beta, state, lengths):
    """Token by token through the decode reference; rows past their length keep their state."""

    def step(state, xs):
        t, q_t, k_t, v_t, g_t, beta_t = xs
        out, stepped = gdn_decode_ref(q_t, k_t, v_t, g_t, beta_t, state)
        return jnp.where((t < lengths)[:, None, None, None], stepped, state), out

    tokens = (jnp.arange(q.shape[1]),) + tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, outs = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(outs, 0, 1), state


def test_state_carries_across_calls():
    """Two calls (each row split at its own point) equal one call over the concatenation, and both equal the
    token-by-token recurrence. Row 2 repeats one key with beta ~ 1 and no decay: the hardest triangular solve."""
    seq, nv = 160, 2
    q, k, v, g, beta, state = make_inputs(2, 3, seq, 1, nv, 16, 16, jnp.float32)
    k = k.at[2].set(k[2, :1])
    beta = beta.at[2].set(0.99)
    g = g.at[2].set(-1e-3)
    lengths = jnp.array([seq, 150, 130], jnp.int32)
    split = np.array([64, 37, 100])  # tokens of each row in the first call

    out_full, state_full = pallas(q, k, v, g, beta, state, lengths)
    first = jnp.asarray(split, jnp.int32)
    out_1, state_1 = pallas(q, k, v, g, beta, state, first)
    rest = [np.arange(seq) + s for s in split]  # each row's continuation, shifted to the front
    take = lambda x: jnp.stack([jnp.take(x[p], np.minimum(rest[p], seq - 1), axis=0) for p in range(3)])  # noqa: E731
    out_2, state_2 = pallas(take(q), take(k), take(v), take(g), take(beta), state_1, lengths - first)
    out_rec, state_rec = jax.jit(recurrence)(q, k, v, g, beta, state, lengths)

    assert relative_error(state_2, state_full) <= 2e-5
    assert relative_error(state_full, state_rec) <= 2e-5
    for p in range(3):
        joined = np.concatenate([out_1[p, : split[p]], out_2[p, : int(lengths[p]) - split[p]]])
        assert relative_error(joined, out_full[p, : int(lengths[p])]) <= 2e-5
        assert relative_error(out_full[p, : int(lengths[p])], out_rec[p, : int(lengths[p])]) <= 2e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_output_slices_match_the_full_width_default(dtype):
    """64-wide output slices (two programs per chunk and head) against the reference within the usual tolerances,
    and against the default output_block_v = dv: each output column is the same sum in both (a slice only chooses
    which columns a program writes), so they agree to summation order (1e-6 relative)."""
    inputs = make_inputs(2, 3, 144, 2, 4, 128, 128, jnp.dtype(dtype))
    lengths = jnp.array([144, 77, 1], jnp.int32)
    out, state = pallas(*inputs, lengths, tuning=tuned(inputs[2], output_block_v=64, output_warps=4))
    out_ref, state_ref = reference(*inputs, lengths)
    assert_matches(out, state, out_ref, state_ref, lengths, dtype)
    out_default, _ = pallas(*inputs, lengths)
    assert relative_error(np.asarray(out, np.float32), np.asarray(out_default, np.float32)) <= 1e-6


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_matches_reference_at_the_real_head_size(dtype):
    """The real head size with both diagonal-block solves the kernel takes (bf16 inputs: repeated squaring; fp32:
    row by row) against the reference within the usual tolerances."""
    inputs = make_inputs(1, 3, 144, 2, 4, 128, 128, jnp.dtype(dtype))
    lengths = jnp.array([144, 77, 1], jnp.int32)
    out, state = pallas(*inputs, lengths)
    out_ref, state_ref = reference(*inputs, lengths)
    assert_matches(out, state, out_ref, state_ref, lengths, dtype)


@pytest.mark.parametrize("solve", [_unit_lower_inverses, _unit_lower_inverses_doubling], ids=["rows", "doubling"])
def test_diagonal_block_inverses_are_exact_in_fp32(solve):
    """Both solves of the WY kernel, called as plain functions, on strictly lower 16 x 16 blocks with entries up to
    1 (near-duplicate keys without decay: every power of L up to L^15 matters; with the model's decays the high
    powers vanish, so the kernel test above cannot see a missing factor): (I + L)^-1 within 1e-4 of the float64
    inverse, relative to its largest entry (measured 3e-7 for both)."""
    rng = np.random.default_rng(0)
    lowers = [np.tril(rng.uniform(-1, 1, (16, 16)), -1) for _ in range(4)]
    inverses = solve([jnp.asarray(x, jnp.float32) for x in lowers])
    for lower, inverse in zip(lowers, inverses, strict=True):
        exact = np.linalg.inv(np.eye(16) + lower)
        assert np.abs(np.asarray(inverse) - exact).max() <= 1e-4 * np.abs(exact).max()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("block_v", [None, 64])
def test_lowers_to_triton_for_h200(dtype, block_v):
    """Without a GPU: every kernel lowers to Triton IR for an abstract H200 at 4B shapes (what interpret mode cannot
    check: every primitive has a Triton lowering, every loaded or stored tile is a power of two)."""
    rows, seq, dtype = 2, 80, jnp.dtype(dtype)
    shapes = [(rows, seq, 16, 128), (rows, seq, 16, 128), (rows, seq, 32, 128), (rows, seq, 32), (rows, seq, 32)]
    dtypes = [dtype, dtype, dtype, jnp.float32, dtype]
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in zip(shapes, dtypes, strict=True)]
    args += [jax.ShapeDtypeStruct((rows, 32, 128, 128), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.int32)]
    tuning = dataclasses.replace(gdn_prefill_tuning(rows, 32, 128), block_v=block_v) if block_v else None
    kernel = functools.partial(gdn_chunked_prefill_pallas, tuning=tuning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's deprecation notice
        module = lower_for_h200(kernel, *args).as_text()
    assert module.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.parametrize("output_block_v, output_warps, slices", [(None, None, "1"), (64, 4, "2")])
def test_output_slices_lower_for_h200(output_block_v, output_warps, slices):
    """The output kernel's grid at 4B heads, (rows x value heads, chunks, dv slices) as Triton gets it: one
    full-width slice by default, two with output_block_v=64."""
    rows, seq, dtype = 2, 80, jnp.bfloat16
    shapes = [(rows, seq, 16, 128), (rows, seq, 16, 128), (rows, seq, 32, 128), (rows, seq, 32), (rows, seq, 32)]
    args = [
        jax.ShapeDtypeStruct(shape, dt) for shape, dt in zip(shapes, [dtype] * 3 + [jnp.float32, dtype], strict=True)
    ]
    args += [jax.ShapeDtypeStruct((rows, 32, 128, 128), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.int32)]
    tiles = {"output_block_v": output_block_v, "output_warps": output_warps} if output_block_v else {}
    tuning = dataclasses.replace(gdn_prefill_tuning(rows, 32, 128), **tiles)
    kernel = functools.partial(gdn_chunked_prefill_pallas, tuning=tuning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        text = lower_for_h200(kernel, *args).as_text()
    grids = re.findall(r"grid_[xyz] = (\d+)", text)
    assert grids[-3:] == ["64", "2", slices]  # the output kernel is the last of the three


@pytest.mark.parametrize("seq", [16, 64])
def test_wrapper_holds_no_nested_jit(seq):
    """lax primitives only around the pallas_calls, the token padding of a short chunk (16) included: the model will
    call the kernel inside stream-annotated regions, where a nested jit fails at run time."""
    spec = jax.ShapeDtypeStruct
    shapes = [(2, seq, 2, 32), (2, seq, 2, 32), (2, seq, 4, 32), (2, seq, 4), (2, seq, 4)]
    dtypes = [jnp.bfloat16] * 3 + [jnp.float32, jnp.bfloat16]
    args = [spec(shape, dt) for shape, dt in zip(shapes, dtypes, strict=True)]
    args += [spec((2, 4, 32, 32), jnp.float32), spec((2,), jnp.int32)]
    jaxpr = jax.make_jaxpr(lambda *a: gdn_chunked_prefill_pallas(*a, interpret=True))(*args)
    names = [eqn.primitive.name for eqn in jaxpr.eqns]
    assert "pallas_call" in names and not {"jit", "pjit", "closed_call"} & set(names), names


def packed(q, k, v):
    """The conv's output as the model hands it over: q, k and v side by side, [P, T, 2 nk dk + nv dv]."""
    return jnp.concatenate([x.reshape(*x.shape[:2], -1) for x in (q, k, v)], axis=-1)


@pytest.mark.parametrize(
    "seq, nk, nv, dk, dv, dtype",
    [(80, 2, 4, 32, 32, "bfloat16"), (64, 1, 2, 16, 16, "float32"), (64, 2, 2, 32, 16, "float32")],
    ids=["ratio2-bf16", "ratio2-fp32", "dk-ne-dv"],
)
def test_packed_reads_q_k_v_from_the_conv_output(seq, nk, nv, dk, dv, dtype):
    """The packed entry point equals the kernel on the three slices bit for bit (the same programs on the same
    values: a wrong head offset into the packed rows reads another head's values), and the packed reference equals
    the reference; ragged rows, T not a multiple of 64, and head dims that differ (which take the slices)."""
    q, k, v, g, beta, state = make_inputs(6, 3, seq, nk, nv, dk, dv, jnp.dtype(dtype))
    lengths = jnp.array([seq, seq - 21, 1], jnp.int32)
    qkv = packed(q, k, v)
    got = jax.jit(lambda *a: gdn_chunked_prefill_packed_pallas(*a, interpret=True))(qkv, g, beta, state, lengths)
    want = pallas(q, k, v, g, beta, state, lengths)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    for x, y in zip(jax.jit(gdn_chunked_prefill_packed_ref)(qkv, g, beta, state, lengths),
                    reference(q, k, v, g, beta, state, lengths), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_packed_lowers_to_triton_for_h200_without_slices():
    """At 4B shapes the packed form lowers to the three Triton kernels and nothing slices the packed rows apart
    (the copies it exists to save)."""
    rows, seq, dtype = 2, 128, jnp.bfloat16
    spec = jax.ShapeDtypeStruct
    args = [spec((rows, seq, 2 * 16 * 128 + 32 * 128), dtype), spec((rows, seq, 32), jnp.float32),
            spec((rows, seq, 32), dtype), spec((rows, 32, 128, 128), jnp.float32), spec((rows,), jnp.int32)]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        text = lower_for_h200(gdn_chunked_prefill_packed_pallas, *args).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    assert "stablehlo.slice" not in text


def test_rejects_tile_unfriendly_head_sizes():
    inputs = make_inputs(3, 1, 64, 1, 1, 24, 16, jnp.float32)
    with pytest.raises(AssertionError, match="powers of two"):
        gdn_chunked_prefill_pallas(*inputs, jnp.array([64], jnp.int32), interpret=True)


# --- GPU, 4B shapes (nk 16, nv 32, dk = dv = 128) -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_matches_reference_at_4b_shapes(dtype):
    seq = 1024
    inputs = make_inputs(4, 4, seq, 16, 32, 128, 128, jnp.dtype(dtype))
    lengths = jnp.array([seq, 700, 0, 1], jnp.int32)
    out, state = pallas(*inputs, lengths, interpret=False)
    with jax.default_matmul_precision("highest"):  # the reference in true fp32, not TF32
        out_ref, state_ref = reference(*inputs, lengths)
    assert_matches(out, state, out_ref, state_ref, lengths, dtype)
    np.testing.assert_array_equal(state[2], inputs[-1][2])


@pytest.mark.gpu
def test_gpu_state_carries_across_calls_at_4b_shapes():
    seq = 512
    q, k, v, g, beta, state = make_inputs(5, 2, 2 * seq, 16, 32, 128, 128, jnp.bfloat16)
    lengths = jnp.array([2 * seq, 2 * seq - 100], jnp.int32)
    run = functools.partial(pallas, interpret=False)
    out_full, state_full = run(q, k, v, g, beta, state, lengths)
    halves = [(x[:, :seq], x[:, seq:]) for x in (q, k, v, g, beta)]
    out_1, state_1 = run(*(h[0] for h in halves), state, jnp.full((2,), seq, jnp.int32))
    out_2, state_2 = run(*(h[1] for h in halves), state_1, lengths - seq)
    _, state_tol = TOLERANCES["bfloat16"]
    assert relative_error(state_2, state_full) <= state_tol
    joined = np.concatenate([np.asarray(out_1, np.float32), np.asarray(out_2, np.float32)], axis=1)
    valid = valid_mask(lengths, 2 * seq)[..., None, None]
    assert relative_error(np.where(valid, joined, 0), np.where(valid, np.asarray(out_full, np.float32), 0)) <= 2.5e-2


@pytest.mark.gpu
def test_gpu_packed_matches_the_slices_at_4b_shapes():
    """The packed form on the GPU at 4B heads, against the kernel on the three slices: the same programs on the same
    values, so bit for bit."""
    q, k, v, g, beta, state = make_inputs(7, 2, 1024, 16, 32, 128, 128, jnp.bfloat16)
    lengths = jnp.array([1024, 700], jnp.int32)
    got = jax.jit(gdn_chunked_prefill_packed_pallas)(packed(q, k, v), g, beta, state, lengths)
    want = pallas(q, k, v, g, beta, state, lengths, interpret=False)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
