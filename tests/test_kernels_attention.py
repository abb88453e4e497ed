"""Paged decode attention: the Pallas kernel against its pure-JAX reference, in interpret mode on the CPU and
compiled on the GPU (`-m gpu`, 4B shapes); and the prefill cases and the softmax step that the prefill attention's
tests (`test_kernels_chunk_attention.py`) build on.

Caches are random normal K/V in pools of several layers (the call reads a traced `layer`, not layer 0); each
row owns distinct random pages, unused page-table entries point at the trash page 0, and padding rows are
what the runner sends (page table all 0; length 1 for decode, 0 for prefill).

Tolerances:
- fp32: both sides compute fp32 scores, an fp32 softmax and an fp32 value product (IEEE dots, no TF32); the
  kernel's online softmax only reorders the sums and rescales by exp(m_old - m_new): measured <= 2e-6 on
  outputs up to ~4 (a few fp32 ulps). atol = rtol = 1e-5 keeps 5x headroom, while any real mistake is far
  larger: one key too many or too few among <= 120 moves an output by |v_j - o| / n, about 1e-2, and a
  wrong layer, page or head by O(1).
- bf16: the reference rounds the normalised probabilities p / l to bf16, the kernel rounds exp(s - m)
  before dividing by l; both are one 2^-9 relative rounding per probability, and the outputs are then
  rounded to bf16 (one ulp is 2^-8 relative). Measured: at most one bf16 ulp apart. atol = rtol = 2^-7
  allows two to three ulps at |o| ~ 1; a one-key masking mistake still moves most outputs by more.
- Chunk padding (prefill queries at or past lengths[p]) is checked for finiteness only: the docstring says
  nobody reads those values, and the kernel skips their keys.
- The prefill softmax runs in base 2 (exp2), which changes only the fp32 rounding of the exponent arguments:
  measured at 4B heads (16/4 x 256, 3 rows of up to 56 keys, block_k 16) fp32 max |o - ref| 1.8e-6 against
  2.0e-6 with exp, so the arguments above hold.
- `prefill_softmax_step` on its own (fp32, no Pallas): the final o / l against a float64 softmax at
  atol = rtol = 1e-5 (the fp32 argument above), and the running max after each block against the float64 one at
  rtol 1e-6 (one fp32 rounding of max * scale).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.kernels.chunk_attention import prefill_softmax_step
from qwen35_jax.kernels.decode_attention import (
    decode_attention_tuning,
    dot_precision,
    empty_softmax_state,
    normalise,
    output_gate,
    paged_decode_attention_pallas,
    paged_decode_attention_ref,
)

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2**-7, rtol=2**-7)}
DTYPES = [pytest.param(jnp.float32, id="fp32"), pytest.param(jnp.bfloat16, id="bf16")]
LAYERS = 2
LAYER = 1  # the last layer of the pool: a kernel that ignores `layer` reads layer 0 and fails


def make_pool(rng, num_pages, page_size, kv_heads, dim, dtype):
    """Random K and V pools [LAYERS, num_pages, page_size, KV, D]."""
    shape = (LAYERS, num_pages, page_size, kv_heads, dim)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(2))


def make_page_table(rng, tokens_per_row, page_size, width):
    """[R, width] int32: distinct random pages (never 0) for each row's tokens, 0 elsewhere; and the pool size."""
    needed = [-(-n // page_size) for n in tokens_per_row]
    pages = rng.permutation(np.arange(1, sum(needed) + 1))
    table = np.zeros((len(needed), width), np.int32)
    used = 0
    for row, n in enumerate(needed):
        table[row, :n] = pages[used : used + n]
        used += n
    return jnp.asarray(table), sum(needed) + 1


def check_close(out, ref, dtype, mask=None):
    assert out.dtype == dtype and out.shape == ref.shape
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    if mask is not None:
        out, ref = out[mask], ref[mask]
    np.testing.assert_allclose(out, ref, **TOL[dtype])


# ---- decode ------------------------------------------------------------------------------------------------


def decode_case(rng, lengths, heads, kv_heads, dim, page_size, dtype, padding_rows=0, width=None):
    """Inputs for rows of `lengths` cached tokens, then `padding_rows` rows as the runner pads them."""
    width = width or -(-max(lengths) // page_size) + 1
    table, num_pages = make_page_table(rng, lengths, page_size, width)
    table = jnp.concatenate([table, jnp.zeros((padding_rows, width), jnp.int32)])
    lengths = jnp.asarray(list(lengths) + [1] * padding_rows, jnp.int32)
    k_pages, v_pages = make_pool(rng, num_pages, page_size, kv_heads, dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), heads, dim), np.float32), dtype)
    return q, k_pages, v_pages, jnp.int32(LAYER), table, lengths


def run_decode(args, **tiles):
    """The kernel in interpret mode with the measured tiles for q's dtype, `tiles` (those not None) replaced."""
    tuning = dataclasses.replace(decode_attention_tuning(args[0].dtype), **{k: v for k, v in tiles.items() if v})
    return jax.jit(lambda *a: paged_decode_attention_pallas(*a, interpret=True, tuning=tuning))(*args)


@pytest.mark.parametrize(
    "page_size, block_k, num_splits",
    [(16, 16, 1), (16, None, 3), (8, 16, None), (32, 16, 5)],
    ids=["ps16-one-split", "ps16-default-block-3-splits", "ps8-block-spans-pages", "ps32-page-spans-blocks"],
)
def test_decode_matches_ref_on_ragged_rows(page_size, block_k, num_splits):
    """Lengths 1, a page minus one, a page, a page plus one (page boundaries) and a long row that is no
    multiple of the page size or block, plus a padding row; uneven splits leave some splits empty."""
    rng = np.random.default_rng([page_size, block_k or 0, num_splits or 0])
    lengths = [1, page_size - 1, page_size, page_size + 1, 3 * page_size + 5]
    args = decode_case(rng, lengths, heads=8, kv_heads=2, dim=32, page_size=page_size, dtype=jnp.float32,
                       padding_rows=1)  # fmt: skip
    out = run_decode(args, block_k=block_k, num_splits=num_splits)
    check_close(out, paged_decode_attention_ref(*args), jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_gqa4_head256(dtype):
    """The 4B head layout: 16 query heads over 4 KV heads of 256, group 4 packed into one tile."""
    rng = np.random.default_rng(4)
    args = decode_case(rng, [37, 70], heads=16, kv_heads=4, dim=256, page_size=16, dtype=dtype)
    out = run_decode(args, block_k=32, num_splits=2)
    check_close(out, paged_decode_attention_ref(*args), dtype)


@pytest.mark.parametrize("heads, kv_heads", [(6, 1), (24, 4), (16, 1)], ids=["group6", "group6-kv4", "group16"])
def test_decode_groups_that_are_not_a_padded_tile(heads, kv_heads):
    """A group that is no power of two (27B's 24 over 4) is padded in memory to the tile; one of 16 fills the tile
    and is neither masked nor padded. Both give the reference's result (the 4B's group of 4 is a masked load)."""
    rng = np.random.default_rng(heads)
    args = decode_case(rng, [9, 40], heads=heads, kv_heads=kv_heads, dim=32, page_size=16, dtype=jnp.float32)
    out = run_decode(args, block_k=16, num_splits=2)
    check_close(out, paged_decode_attention_ref(*args), jnp.float32)


def with_gate(rng, args):
    """args plus an output gate [B, H, D] in q's dtype (normal: sigmoids from ~0.05 to ~0.95)."""
    q = args[0]
    return (*args, jnp.asarray(rng.standard_normal(q.shape, np.float32), q.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "3-splits"])
def test_decode_with_a_gate_merges_and_gates_in_a_kernel(dtype, num_splits):
    """With the output gate, a power-of-two group's splits are merged and gated by the second kernel: the
    reference's gated output (`output_gate` after the attention), a padding row included. The bf16 gate adds one
    rounding of a product by a sigmoid <= 1, inside TOL's two to three ulps."""
    rng = np.random.default_rng(num_splits)
    args = with_gate(rng, decode_case(rng, [5, 37, 70], heads=16, kv_heads=4, dim=256, page_size=16, dtype=dtype,
                                      padding_rows=1))  # fmt: skip
    tuning = dataclasses.replace(decode_attention_tuning(dtype), block_k=16, num_splits=num_splits)
    kernel = functools.partial(paged_decode_attention_pallas, interpret=True, tuning=tuning)
    assert "decode_attention_merge" in str(jax.make_jaxpr(kernel)(*args))
    out = jax.jit(kernel)(*args)
    ref = paged_decode_attention_ref(*args)
    check_close(out, ref, dtype)
    ungated = paged_decode_attention_ref(*args[:-1])
    assert np.abs(np.asarray(ref, np.float32) - np.asarray(ungated, np.float32)).max() > 0.1  # the gate mattered
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(output_gate(ungated, args[-1])))


@pytest.mark.parametrize("heads, kv_heads", [(16, 4), (6, 1)], ids=["merge-kernel", "padded-group"])
def test_decode_reads_the_first_rows_of_a_longer_q(heads, kv_heads):
    """A unified step passes q and the gate of all its tokens, decode rows first: the result is that of the first
    lengths.shape[0] rows alone, whatever the rows after them hold."""
    rng = np.random.default_rng(heads)
    args = with_gate(rng, decode_case(rng, [9, 40], heads=heads, kv_heads=kv_heads, dim=32, page_size=16,
                                      dtype=jnp.float32))  # fmt: skip
    q, gate = args[0], args[-1]
    extra = jnp.asarray(rng.standard_normal((5, *q.shape[1:]), np.float32)) * 100
    longer = (jnp.concatenate([q, extra]), *args[1:-1], jnp.concatenate([gate, extra]))
    kernel = jax.jit(functools.partial(paged_decode_attention_pallas, interpret=True))
    np.testing.assert_array_equal(np.asarray(kernel(*longer)), np.asarray(kernel(*args)))
    check_close(kernel(*longer), paged_decode_attention_ref(*args), jnp.float32)
    np.testing.assert_array_equal(np.asarray(paged_decode_attention_ref(*longer)),
                                  np.asarray(paged_decode_attention_ref(*args)))  # fmt: skip


def test_decode_with_a_gate_and_a_padded_group_gates_in_xla():
    """A group of 6 (padded to the tile in memory) merges in XLA and is gated there: the same result."""
    rng = np.random.default_rng(6)
    args = with_gate(rng, decode_case(rng, [9, 40], heads=6, kv_heads=1, dim=32, page_size=16, dtype=jnp.float32))
    kernel = functools.partial(paged_decode_attention_pallas, interpret=True)
    assert "decode_attention_merge" not in str(jax.make_jaxpr(kernel)(*args))
    check_close(jax.jit(kernel)(*args), paged_decode_attention_ref(*args), jnp.float32)


def test_decode_reads_nothing_past_length():
    """The tail of each row's last page and the unused page-table entries hold NaN pages or garbage ids; the
    kernel must give the reference's result on the clean cache, so it never read them."""
    rng = np.random.default_rng(7)
    page_size, lengths = 16, [5, 21, 40]
    q, k_pages, v_pages, layer, table, lengths_arr = decode_case(
        rng, lengths, heads=4, kv_heads=2, dim=32, page_size=page_size, dtype=jnp.float32, width=5
    )
    ref = paged_decode_attention_ref(q, k_pages, v_pages, layer, table, lengths_arr)
    k_bad, v_bad, bad_table = poison(k_pages, v_pages, table, [0] * len(lengths), lengths, page_size)
    out = run_decode((q, k_bad, v_bad, layer, bad_table, lengths_arr), block_k=16, num_splits=2)
    check_close(out, ref, jnp.float32)


def poison(k_pages, v_pages, table, start, lengths, page_size):
    """NaN at every cached position >= start + length of each row, in the trash page 0 and in a spare last
    page; unused table entries become out-of-range ids (clamped to the NaN page in interpret mode)."""
    table = np.array(table)
    k_pages, v_pages = np.array(k_pages), np.array(v_pages)
    for row, (s, n) in enumerate(zip(start, lengths, strict=True)):
        end = s + n
        used = -(-end // page_size) if end else 0
        for position in range(end, used * page_size):
            for pages in (k_pages, v_pages):
                pages[:, table[row, position // page_size], position % page_size] = np.nan
        table[row, used:] = 10**6
    for pages in (k_pages, v_pages):
        pages[:, 0] = np.nan
    k_pages = np.concatenate([k_pages, np.full_like(k_pages[:, :1], np.nan)], axis=1)
    v_pages = np.concatenate([v_pages, np.full_like(v_pages[:, :1], np.nan)], axis=1)
    return jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table)


# ---- prefill -----------------------------------------------------------------------------------------------


def prefill_case(rng, starts, lengths, chunk, heads, kv_heads, dim, page_size, dtype, width=None):
    """Rows with `starts` tokens cached before a chunk of `lengths` valid tokens (padded to `chunk`); a row
    of length 0 is a padding row (page table all 0, start 0)."""
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    width = width or -(-max(ends) // page_size) + 1
    table, num_pages = make_page_table(rng, ends, page_size, width)
    k_pages, v_pages = make_pool(rng, num_pages, page_size, kv_heads, dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(starts), chunk, heads, dim), np.float32), dtype)
    start, length = jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32)
    return q, k_pages, v_pages, jnp.int32(LAYER), table, start, length


def compare_prefill(out, ref, lengths, dtype):
    """Valid queries (chunk index < lengths[p]) against the reference; every output finite."""
    valid = np.arange(ref.shape[1])[None, :] < np.asarray(lengths)[:, None]  # [P, T]
    check_close(out, ref, dtype, np.broadcast_to(valid[:, :, None, None], ref.shape))


def test_prefill_softmax_step_matches_a_float64_softmax():
    """`prefill_softmax_step` over 7 key blocks of raw scores (fp32): row 0 never sees a key (o = 0, l = 0,
    m = -inf, no NaN), row 1 sees none in the first two blocks, row 2 gets a key 150 natural units above its
    max in block 4 (2^216: overflow unless rescaled), row 3 one about 7 above in block 3 (2^10). The running max
    after each block is the exact one (in units of scale * log2(e)), and o / l is softmax(scale * scores) v."""
    rng = np.random.default_rng(13)
    blocks, rows, block_k, dim, scale = 7, 4, 8, 16, 0.25
    raw = (4 * rng.standard_normal((blocks, rows, block_k))).astype(np.float32)  # scale * raw ~ N(0, 1)
    raw[:, 0] = -np.inf
    raw[:2, 1] = -np.inf
    raw[4, 2, 3] = 150 / scale
    raw[3, 3, 5] = raw[:3, 3].max() + 7 / scale
    v = rng.standard_normal((blocks, block_k, dim)).astype(np.float32)
    block_max = raw.astype(np.float64).max(axis=-1) * scale * math.log2(math.e)  # [blocks, rows]
    exact = np.maximum.accumulate(block_max, axis=0)
    weights = np.exp(raw.astype(np.float64) * scale).transpose(1, 0, 2).reshape(rows, -1)  # finite: max 150
    expected = weights @ v.reshape(-1, dim).astype(np.float64) / np.maximum(weights.sum(axis=1), 1e-300)[:, None]

    step = jax.jit(functools.partial(prefill_softmax_step, precision=dot_precision(jnp.float32), scale=scale))
    carry = empty_softmax_state(rows, dim)
    for block in range(blocks):
        carry = step(carry, jnp.asarray(raw[block]), jnp.asarray(v[block]))
        o, m, l = (np.asarray(x) for x in carry)
        assert np.isfinite(o).all() and np.isfinite(l).all(), block
        assert (o[0] == 0).all() and l[0] == 0 and m[0] == -np.inf
        np.testing.assert_allclose(m[1:], exact[block, 1:], rtol=1e-6, atol=0)
        assert (m[1] == -np.inf) == (block < 2)
    np.testing.assert_allclose(np.asarray(normalise(*carry[::2])), expected, **TOL[jnp.float32])


# ---- shared ------------------------------------------------------------------------------------------------


def test_wrapper_holds_no_nested_jit():
    """The XLA code around the pallas_call is lax primitives only: the model calls the kernel inside
    stream-annotated regions, where a nested jit (jnp.pad, jnp.where) fails at run time."""
    shape = jax.ShapeDtypeStruct
    i32 = jnp.int32
    pages = shape((LAYERS, 8, 16, 2, 32), jnp.float32)
    decode = jax.make_jaxpr(lambda *a: paged_decode_attention_pallas(*a, interpret=True))(
        shape((3, 6, 32), jnp.float32), pages, pages, shape((), i32), shape((3, 4), i32), shape((3,), i32)
    )
    names = [eqn.primitive.name for eqn in decode.eqns]
    assert "pallas_call" in names and not {"jit", "pjit", "closed_call"} & set(names), names


# ---- GPU, 4B shapes ----------------------------------------------------------------------------------------


def gpu_ref(ref, args):
    """The reference on the GPU with IEEE fp32 dots (XLA may otherwise use TF32 for fp32; the kernel does not)."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(ref)(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("page_size", [16, 32])
def test_gpu_decode_4b(batch, page_size):
    rng = np.random.default_rng(batch)
    lengths = rng.integers(1, 4096, batch).tolist()
    lengths[0] = 1
    args = decode_case(rng, lengths, heads=16, kv_heads=4, dim=256, page_size=page_size, dtype=jnp.bfloat16,
                       padding_rows=1, width=4096 // page_size)  # fmt: skip
    out = jax.jit(paged_decode_attention_pallas)(*args)
    check_close(out, gpu_ref(paged_decode_attention_ref, args), jnp.bfloat16)
    gated = with_gate(rng, args)  # the merge kernel
    check_close(jax.jit(paged_decode_attention_pallas)(*gated), gpu_ref(paged_decode_attention_ref, gated),
                jnp.bfloat16)  # fmt: skip


# The 4B GPU prefill cases: a long chunk fresh and after a 1000-token prefix, a short one after 3000 and 7 tokens.
GPU_PREFILL_CASES = pytest.mark.parametrize("chunk, starts", [(512, [0, 1000]), (16, [3000, 7])],
                                            ids=["long-chunk", "short-chunk"])  # fmt: skip


def gpu_prefill_case(rng, dtype, chunk, starts):
    """(args, lengths): two rows of `chunk` and chunk - 3 valid tokens after `starts`, then a padding row; 4B heads,
    pages of 16, a table 4096 tokens wide."""
    lengths = [chunk, chunk - 3, 0]
    args = prefill_case(rng, starts + [0], lengths, chunk, heads=16, kv_heads=4, dim=256, page_size=16, dtype=dtype,
                        width=4096 // 16)  # fmt: skip
    return args, lengths


@pytest.mark.gpu
def test_gpu_pool_over_4_gib_uses_64_bit_offsets():
    """A pool past 4 GiB per array makes the Triton lowering switch to 64-bit offsets; read its last pages."""
    page_size, kv_heads, dim, layers, num_pages = 16, 4, 256, 8, 36000  # 9.4 GB per pool
    rng = np.random.default_rng(0)
    fill = jnp.asarray(rng.standard_normal((layers, 64, page_size, kv_heads, dim), np.float32), jnp.bfloat16)
    pool = jax.jit(lambda last: jnp.zeros((layers, num_pages, page_size, kv_heads, dim), jnp.bfloat16)
                   .at[:, num_pages - 64 :].set(last))  # fmt: skip
    k_pages, v_pages = pool(fill), pool(-fill)
    table = jnp.asarray(np.arange(num_pages - 64, num_pages, dtype=np.int32).reshape(2, 32))
    q = jnp.asarray(rng.standard_normal((2, 16, dim), np.float32), jnp.bfloat16)
    args = (q, k_pages, v_pages, jnp.int32(layers - 1), table, jnp.asarray([500, 512], jnp.int32))
    out = jax.jit(paged_decode_attention_pallas)(*args)
    check_close(out, gpu_ref(paged_decode_attention_ref, args), jnp.bfloat16)
