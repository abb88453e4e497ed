"""Prefill attention split into the chunk part and the prefix pass (`kernels/chunk_attention.py`): against the
one-formula reference `paged_prefill_attention_ref`, which reads every key from the pages, in interpret mode on
the CPU (the chunk part is then `chunk_attention_ref`) and compiled on the GPU (`-m gpu`: tokamax's Mosaic GPU
kernel, 4B shapes).

Inputs are the attention tests' (`prefill_case`: random pools of several layers, distinct random pages per row,
padding rows); the chunk's own k and v are what the pages hold at start + i for the valid tokens, as after the
model writes them, and random for the chunk's padding tokens.

Tolerances are the attention tests' (`TOL`), and why they hold here:
- fp32: the chunk part and the prefix pass compute in fp32; folding the chunk part in as (o_c, lse_c, sum 1)
  multiplies o_c by exp(lse_c - m) instead of summing its terms under m, a few fp32 roundings: measured
  <= 6e-7 on the ragged cases against the 1e-5 allowed.
- bf16: a row with a prefix is rounded to bf16 twice (o_c, then the merged result), one more 2^-8 relative
  rounding than attention in one pass; with the probabilities' roundings that is still within 2^-7.
- Rows with start = 0 are the chunk part's output bit for bit (the prefix pass leaves their tiles alone).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200
from test_kernels_attention import (
    DTYPES,
    GPU_PREFILL_CASES,
    LAYER,
    TOL,
    compare_prefill,
    gpu_prefill_case,
    gpu_ref,
    poison,
    prefill_case,
)
from test_kernels_gdn_decode import triton_modules  # the Triton IR of a lowered pallas_call

from qwen35_jax import kernels
from qwen35_jax.kernels import chunk_attention
from qwen35_jax.kernels.chunk_attention import (
    chunk_attention_ref,
    paged_prefill_attention_ref,
    prefill_attention_pallas,
    prefill_attention_ref,
    prefix_merge_pallas,
    prefix_tuning,
)


def with_chunk_kv(rng, args):
    """(q, k, v, k_pages, ...): the chunk's k, v [P, T, KV, D] read from the pages at start + i for valid tokens,
    random for padding tokens (nobody's valid query sees them)."""
    q, k_pages, v_pages, layer, table, start, lengths = args
    rows, chunk = q.shape[:2]
    page_size = k_pages.shape[2]
    out = []
    for pages in (k_pages, v_pages):
        pages = np.asarray(pages, np.float32)
        kv = rng.standard_normal((rows, chunk, *pages.shape[3:])).astype(np.float32)
        for row in range(rows):
            for i in range(int(lengths[row])):
                position = int(start[row]) + i
                kv[row, i] = pages[LAYER, int(table[row, position // page_size]), position % page_size]
        out.append(jnp.asarray(kv, q.dtype))
    return (q, *out, k_pages, v_pages, layer, table, start, lengths)


def run_split(args, tile_rows=None, block_k=None):
    """The split form in interpret mode with the measured prefix-pass tiles for q's dtype, tile_rows and block_k
    replaced where given."""
    tiles = {k: v for k, v in dict(tile_rows=tile_rows, block_k=block_k).items() if v}
    tuning = dataclasses.replace(prefix_tuning(args[0].dtype), **tiles)
    return jax.jit(lambda *a: prefill_attention_pallas(*a, interpret=True, tuning=tuning))(*args)


def paged_only(args):
    """The one-formula reference on split-form arguments (it reads the chunk from the pages)."""
    q, _, _, *rest = args
    return paged_prefill_attention_ref(q, *rest)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "page_size, tile_rows, block_k",
    [(16, None, 16), (8, 16, 16), (32, 32, 8)],
    ids=["ps16-default-q-block", "ps8-block-spans-pages", "ps32-blocks-within-a-page"],
)
def test_split_matches_ref_on_ragged_rows(dtype, page_size, tile_rows, block_k):
    """A fresh prompt (start 0: the prefix pass skips it); a chunk starting 3 tokens before a page boundary with a
    ragged length (its prefix ends inside a key block: the masked last block); a one-token chunk after a long
    prefix; a padding row. The chunk (24) is no multiple of the query block, so the tiles are padded (tile rows
    16 and 32 are query blocks of 4 and 8 at group 4)."""
    rng = np.random.default_rng([page_size, block_k])
    chunk = 24
    starts, lengths = [0, 4 * page_size - 3, 8 * page_size + 7, 0], [chunk, chunk - 5, 1, 0]
    args = with_chunk_kv(rng, prefill_case(rng, starts, lengths, chunk, heads=8, kv_heads=2, dim=32,
                                           page_size=page_size, dtype=dtype))  # fmt: skip
    ref = paged_only(args)
    compare_prefill(run_split(args, tile_rows=tile_rows, block_k=block_k), ref, lengths, dtype)
    compare_prefill(prefill_attention_ref(*args), ref, lengths, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_gqa4_head256(dtype):
    """4B head layout; one chunk continues a 21-token prefix across the page boundary at 32, one starts fresh."""
    rng = np.random.default_rng(5)
    starts, lengths = [21, 0], [16, 11]
    args = with_chunk_kv(rng, prefill_case(rng, starts, lengths, 16, heads=16, kv_heads=4, dim=256, page_size=16,
                                           dtype=dtype))  # fmt: skip
    compare_prefill(run_split(args, block_k=16), paged_only(args), lengths, dtype)


def test_rows_without_prefix_are_the_chunk_part_bit_for_bit():
    """start = 0 rows: the prefix pass returns at once and the aliased output keeps the chunk part's values."""
    rng = np.random.default_rng(3)
    args = with_chunk_kv(rng, prefill_case(rng, [0, 40], [20, 20], 20, heads=8, kv_heads=2, dim=32, page_size=8,
                                           dtype=jnp.bfloat16))  # fmt: skip
    out = np.asarray(run_split(args), np.float32)
    chunk_out, _ = chunk_attention_ref(*args[:3])
    np.testing.assert_array_equal(out[0], np.asarray(chunk_out, np.float32)[0])
    assert not np.array_equal(out[1], np.asarray(chunk_out, np.float32)[1])  # the prefix row was folded


def test_prefix_pass_reads_nothing_at_or_past_start():
    """NaN pages at every position >= start (the chunk's own positions included), NaN trash page, garbage page
    ids past the prefix: the split version takes the chunk from k and v, so it still matches."""
    rng = np.random.default_rng(9)
    page_size, chunk = 8, 12
    starts, lengths = [13, 16, 0], [12, 9, 7]
    args = with_chunk_kv(rng, prefill_case(rng, starts, lengths, chunk, heads=4, kv_heads=2, dim=32,
                                           page_size=page_size, dtype=jnp.float32))  # fmt: skip
    ref = paged_only(args)
    q, k, v, k_pages, v_pages, layer, table, start, length = args
    k_bad, v_bad, bad_table = poison(k_pages, v_pages, table, starts, [0] * len(starts), page_size)
    out = run_split((q, k, v, k_bad, v_bad, layer, bad_table, start, length), tile_rows=16, block_k=8)
    compare_prefill(out, ref, lengths, jnp.float32)


def test_chunk_attention_ref_lse():
    """lse is the natural log-sum-exp of each query's scaled causal scores (float64 on the host)."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 9, h, 16)), jnp.float32) for h in (4, 2, 2))
    out, lse = chunk_attention_ref(q, k, v)
    scores = np.einsum("rqhd,rshd->rqhs", np.float64(q), np.repeat(np.float64(k), 2, axis=2)) / 4.0
    scores = np.where(np.tril(np.ones((9, 9), bool))[None, :, None, :], scores, -np.inf)
    expected = np.log(np.exp(scores).sum(-1))
    np.testing.assert_allclose(np.asarray(lse), expected, rtol=1e-6, atol=1e-6)
    probs = np.exp(scores - expected[..., None])
    values = np.einsum("rqhs,rshd->rqhd", probs, np.repeat(np.float64(v), 2, axis=2))
    np.testing.assert_allclose(np.asarray(out), values, **TOL[jnp.float32])


def test_pallas_on_a_gpu_without_tokamax_fails_before_any_weight(monkeypatch):
    """check_selectable (run by the flags before weights load) names the missing library and the way out."""

    def missing():
        raise ImportError("No module named 'tokamax'")

    monkeypatch.setattr(chunk_attention, "tokamax_attention", missing)
    with pytest.raises(ValueError, match="--kernels pallas: No module named 'tokamax'"):
        kernels.check_selectable("pallas", platform="gpu")
    kernels.check_selectable("ref", platform="gpu")


def test_tokamax_missing_message_says_what_to_do(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tokamax(name, *args, **kwargs):
        if name.startswith("tokamax"):
            raise ImportError("No module named 'tokamax'")
        return real_import(name, *args, **kwargs)

    chunk_attention.tokamax_attention.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_tokamax)
    with pytest.raises(ImportError, match=r"pip install 'qwen35-jax\[gpu\]'.*--kernels ref"):
        chunk_attention.tokamax_attention()


def test_prefix_pass_holds_no_nested_jit():
    """lax primitives only around the pallas_call: the model calls it inside stream-annotated regions, where a
    nested jit fails at run time."""
    spec = jax.ShapeDtypeStruct
    pages = spec((2, 8, 16, 2, 32), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda *a: prefix_merge_pallas(*a, interpret=True))(
        spec((3, 20, 6, 32), jnp.float32), spec((3, 20, 6, 32), jnp.float32), spec((3, 20, 6), jnp.float32), pages,
        pages, spec((), jnp.int32), spec((3, 4), jnp.int32), spec((3,), jnp.int32),
    )  # fmt: skip
    names = [eqn.primitive.name for eqn in jaxpr.eqns]
    assert "pallas_call" in names and not {"jit", "pjit", "closed_call"} & set(names), names


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_prefix_pass_lowers_for_h200_in_place():
    """The 4B prefix pass at an 8192-token chunk: grid 1 x 4 KV heads x 256 query blocks, one Triton kernel whose
    output aliases the chunk part's output (no copy of a 64 MiB tile buffer), no pad around it. Its softmax calls
    libdevice's exp2f and no expf, and the unmasked key loop (the first scf.for) holds no per-lane division or
    remainder of the page index (the static page alignment of block_k 64 over pages of 16)."""
    spec = jax.ShapeDtypeStruct
    pages = spec((2, 600, 16, 4, 256), jnp.bfloat16)
    q = spec((1, 8192, 16, 256), jnp.bfloat16)
    lowered = lower_for_h200(prefix_merge_pallas, q, q, spec((1, 8192, 16), jnp.float32), pages, pages,
                             spec((), jnp.int32), spec((1, 512), jnp.int32), spec((1,), jnp.int32))  # fmt: skip
    text = lowered.as_text()
    assert "output_operand_aliases" in text and "stablehlo.pad" not in text
    assert re.findall(r"grid_[xyz] = (\d+)", text) == ["1", "4", "256"]
    [triton] = triton_modules(lowered)
    assert "__nv_exp2f" in triton and "__nv_expf" not in triton
    unmasked_loop = triton[triton.index("scf.for") : triton.index("scf.yield")]
    per_lane_index = re.findall(r"arith\.(?:divsi|remsi) .* : tensor<64xi32>", unmasked_loop)
    assert not per_lane_index, per_lane_index


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_fp32_prefix_pass_takes_the_fp32_tiles():
    """fp32 takes the fp32 tiles of `prefix_tuning` (32 rows: query blocks of 8 for group 4): at bf16's 128-row
    tiles the H200 refused the fp32 program (288 KiB of shared memory)."""
    spec = jax.ShapeDtypeStruct
    pages = spec((2, 64, 16, 4, 256), jnp.float32)
    q = spec((1, 512, 16, 256), jnp.float32)
    lowered = lower_for_h200(prefix_merge_pallas, q, q, spec((1, 512, 16), jnp.float32), pages, pages,
                             spec((), jnp.int32), spec((1, 32), jnp.int32), spec((1,), jnp.int32))  # fmt: skip
    assert re.findall(r"grid_[xyz] = (\d+)", lowered.as_text()) == ["1", "4", "64"]


# ---- GPU, 4B shapes ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@GPU_PREFILL_CASES
def test_gpu_split_prefill_4b(dtype, chunk, starts):
    """bf16: the chunk part on tokamax's Mosaic GPU kernel; fp32: on chunk_attention_ref (see the module)."""
    rng = np.random.default_rng(chunk)
    args, lengths = gpu_prefill_case(rng, dtype, chunk, starts)
    args = with_chunk_kv(rng, args)
    out = jax.jit(prefill_attention_pallas)(*args)
    compare_prefill(out, gpu_ref(lambda *a: paged_only(a), args), lengths, dtype)


@pytest.mark.gpu
def test_gpu_tokamax_chunk_part_matches_ref():
    """The chunk part alone: tokamax's (o, lse) against chunk_attention_ref's at a 1024-token chunk, 4B heads
    (lse: fp32 sums in a different order, 1e-4 relative; o: the bf16 tolerance)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 1024, h, 256)), jnp.bfloat16) for h in (16, 4, 4))
    out, lse = jax.jit(chunk_attention.chunk_attention_tokamax)(q, k, v)
    ref_out, ref_lse = gpu_ref(chunk_attention_ref, (q, k, v))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), **TOL[jnp.bfloat16])
