"""Prefill attention in two parts: the chunk over its own keys (a library flash kernel), then the paged prefix.

Math: the query at chunk index i of row p sits at position start[p] + i and attends to the cached positions
j < start[p] (the prefix, in the pages) and to the chunk's own keys at indices j <= i, softmax over both in fp32
(`paged_prefill_attention_ref` reads all of them from the pages). Split by keys:
    chunk part   (o_c, lse_c) = causal attention of the chunk's q over its own k, v (contiguous, as projected)
    prefix part  a pass over the prefix pages that starts its online softmax from the chunk part: running max
                 lse_c, sum 1, accumulator o_c, which is exactly the chunk part's contribution to the
                 softmax's numerator and denominator (o_c = sum_j e^{s_j - lse_c} v_j, sum_j e^{s_j - lse_c} = 1).
Folding the prefix blocks in and dividing by the final sum gives the attention over both.

Layouts:
    q            [P, T, H, D] model dtype (after q_norm and RoPE)
    k, v         [P, T, KV, D] the chunk's keys and values, which the caller has also written into the pages
    k_pages      [L, N, page_size, KV, D];  v_pages the same;  layer int32 scalar
    page_table   [P, W] int32;  start [P] int32 tokens cached before this chunk;  lengths [P] valid chunk tokens
Returns o [P, T, H, D] in q's dtype; queries past lengths[p] give finite values nobody reads.

Why: tokamax's Mosaic GPU flash attention for Hopper (TMA loads from a producer warpgroup, wgmma, two consumer
warpgroups; FlashAttention-3's schedule) runs the dense causal problem of an 8192-token chunk at 4B heads in
893 us, 77.9% of the bf16 roofline, against 1504 us (46.3%) for a one-kernel Triton flash attention that reads
the chunk's keys from the pages too (H200; 1k: 37.6 against 65.8 us; 2k: 102.0 against 133.3). tokamax reads no
pages, but the chunk's own keys need none: they are the projection's output, contiguous. Only the prefix is
paged, and it sees no causal mask (every prefix key precedes every query), so a simple Triton pass reads it.
Prompts that fit one chunk (start = 0 everywhere) skip that pass: its programs return at once and the chunk
part's output, which the pass updates in place (input/output aliasing), is the result.

- `chunk_attention_tokamax(q, k, v) -> (o, lse)`: tokamax 0.0.17 at `TokamaxConfig`, bf16 or fp16. Imported when
  first called; `pip install 'qwen35-jax[gpu]'` installs it.
- `chunk_attention_ref(q, k, v) -> (o, lse)`: the same in pure JAX, which the CPU (interpret-mode) tests and
  fp32 use.
- `prefix_merge_pallas(...)`: the prefix pass (Triton lowering; `interpret=True` on the CPU), tiled by
  `PrefixTuning`.
- `prefill_attention_ref` / `prefill_attention_pallas`: the whole attention, beside each other.

Numerics: tokamax rounds o_c to the model dtype and keeps lse in fp32; a row with a prefix is then folded in
fp32 and rounded once more, so it is within about two bf16 roundings of the exact result (one when start = 0).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qwen35_jax.kernels.decode_attention import (
    attend,
    dot_precision,
    finite_max,
    gather_pages,
    load_kv_block,
    loop_key_blocks,
    matmul,
    normalise,
    pad_to,
)


@dataclasses.dataclass(frozen=True)
class TokamaxConfig:
    """tokamax's sm90 flash-attention config. block_q is per consumer warpgroup (two of them: 128 query rows a
    CTA); block_kv keys a TMA stage. At head_dim 256 this is the only one of the three measured (block_kv 64 or
    128, 2 or 3 stages) whose q tile and K/V stages fit shared memory."""

    block_q: int = 64
    block_kv: int = 64
    num_stages: int = 2


TOKAMAX_CONFIG = TokamaxConfig()


def paged_prefill_attention_ref(q, k_pages, v_pages, layer, page_table, start, lengths):
    """The attention with every key read from the pages (the chunk's own too, already written there): the
    one-formula oracle of the split form, q [P, T, H, D] -> o [P, T, H, D]."""
    k = gather_pages(k_pages, layer, page_table)
    v = gather_pages(v_pages, layer, page_table)
    query_pos = start[:, None] + jnp.arange(q.shape[1])[None, :]  # [P, T]
    mask = jnp.arange(k.shape[1])[None, None, :] <= query_pos[:, :, None]
    return attend(q, k, v, mask, q.shape[-1] ** -0.5)


def chunk_attention_ref(q, k, v):
    """Causal attention of a chunk over its own keys: q [P, T, H, D], k, v [P, T, KV, D] -> (o [P, T, H, D] in
    q's dtype, lse [P, T, H] fp32, natural log of the softmax's sum under the scaled scores)."""
    rows, chunk, heads, dim = q.shape
    kv_heads = k.shape[2]
    # fp32: IEEE products, as the Triton kernels' (XLA would take TF32 for fp32 dots on the GPU by default).
    dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32, precision=dot_precision(q.dtype))
    qg = q.reshape(rows, chunk, kv_heads, heads // kv_heads, dim)
    scores = dot("rqkgd,rskd->rkgqs", qg, k) * dim**-0.5
    causal = jnp.arange(chunk)[:, None] >= jnp.arange(chunk)[None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [P, KV, G, T]
    probs = jnp.exp(scores - lse[..., None]).astype(q.dtype)
    out = dot("rkgqs,rskd->rqkgd", probs, v)
    return out.reshape(q.shape).astype(q.dtype), lse.transpose(0, 3, 1, 2).reshape(rows, chunk, heads)


@functools.cache
def tokamax_attention(config: TokamaxConfig = TOKAMAX_CONFIG):
    """tokamax's Mosaic GPU flash attention op at `config`; ImportError saying what to do without it."""
    try:
        from tokamax._src.ops.attention import pallas_mosaic_gpu
    except ImportError as error:
        raise ImportError(
            "prefill attention in the pallas kernel set runs the chunk part on tokamax's Mosaic GPU kernel: "
            f"install it (pip install 'qwen35-jax[gpu]'), or run the reference kernels (--kernels ref) ({error})"
        ) from error
    sm90 = pallas_mosaic_gpu.ConfigSM90(**dataclasses.asdict(config))
    return pallas_mosaic_gpu.PallasMosaicGpuFlashAttention(config=sm90)


def chunk_attention_tokamax(q, k, v, *, config: TokamaxConfig = TOKAMAX_CONFIG):
    """`chunk_attention_ref` on tokamax's Mosaic GPU flash kernel (Hopper; 2-byte dtypes)."""
    out, (m, l) = tokamax_attention(config)(q, k, v, is_causal=True, return_residuals=True)
    lse = m + lax.log(l)  # m: the running max of the scaled scores (natural units), l: the sum under it
    return out, lax.transpose(lse, (0, 2, 1))  # [P, H, T] -> [P, T, H]


def prefill_attention_ref(q, k, v, k_pages, v_pages, layer, page_table, start, lengths):
    """The whole prefill attention in pure JAX: the prefix from the pages, the chunk from k and v."""
    del lengths  # queries past a row's length see padding keys of their own chunk; nobody reads them
    prefix_k = gather_pages(k_pages, layer, page_table)
    prefix_v = gather_pages(v_pages, layer, page_table)
    chunk = q.shape[1]
    keys, values = jnp.concatenate([prefix_k, k], axis=1), jnp.concatenate([prefix_v, v], axis=1)
    in_prefix = jnp.arange(prefix_k.shape[1])[None, None, :] < start[:, None, None]  # [P, 1, S]
    causal = jnp.arange(chunk)[None, None, :] <= jnp.arange(chunk)[None, :, None]  # [1, T, T]
    mask = jnp.concatenate([jnp.broadcast_to(in_prefix, (q.shape[0], chunk, in_prefix.shape[2])),
                            jnp.broadcast_to(causal, (q.shape[0], chunk, chunk))], axis=2)  # fmt: skip
    return attend(q, keys, values, mask, q.shape[-1] ** -0.5)


# ---- the prefix pass (Pallas, Triton lowering) ---------------------------------------------------------------
#
# Grid (P, KV, T / block_q): one program per (row, KV head, block of block_q queries). Its tile is the block's
# queries times the `group` query heads of that KV head, [block_q * group, D] (GQA packing: K/V of a head are read
# once for all its query heads). A program of a row with start = 0 returns at once: its output tile aliases the
# chunk part's output, which is then the result. Otherwise it loads the chunk part's o and lse for its tile, walks
# the prefix's key blocks [0, cdiv(start, block_k)) (only the last block is masked, at start), and writes the
# normalised result over the chunk part's output. Keys are gathered through the page table (any page size; a block
# may span pages), and nothing at or past start is read.
#
# The CUDA-core work per key block (between the two tensor-core products: scale, max, exp, sum, rounding of the
# [M, block_k] scores and the rescaling of the [M, D] accumulator) is kept short:
# - the online softmax runs in base 2 (`prefill_softmax_step`): the raw q.k scores are multiplied by
#   scale * log2(e) once (an FMA with the max subtraction), the running max m is kept in those units, and p and
#   the correction are exp2(...): libdevice's __nv_exp2f is one ex2.approx, __nv_expf the same behind about six
#   more instructions of range reduction. The result differs from exp's by the fp32 rounding of the exponent
#   arguments (~1e-6 relative per probability at the largest ones).
# - an unmasked key block takes its page ids and in-page offsets from the static block and page sizes
#   (`_aligned_kv_loader`) instead of a per-lane division and remainder every block.
# One-kernel flash attention over the pages at an 8192-token chunk on the H200 (same tiles): exp 1601.8 us, exp2
# 1511.7 us, exp2 + static page index 1494.6 us.
#
# Numerics: scores and softmax state in fp32, exp2(s - m) rounded to the model dtype before the value product,
# divided by the fp32 sum at the end; fp32 dots in IEEE fp32 (no TF32).

LOG2_E = math.log2(math.e)


def prefill_softmax_step(carry, scores, v, precision, *, scale: float):
    """Fold one key block into the running (o [M, D], m [M], l [M]). scores [M, block_k] are the raw q.k products in
    fp32 (not yet scaled), -inf where masked; m is kept in units of scale * log2(e) * q.k and the exponentials are
    exp2. A row that has seen no visible key yet keeps m = -inf, l = 0, o = 0 (no NaN)."""
    factor = scale * LOG2_E
    o, m, l = carry
    block_max = scores.max(axis=-1) * factor  # = max of the scaled scores: rounding is monotone
    m_next = jnp.maximum(m, block_max)
    correction = jnp.exp2(m - finite_max(m_next))  # 0 for rows with m = -inf: their o and l are 0 anyway
    o, l = correction[:, None] * o, correction * l
    p = jnp.exp2(scores * factor - finite_max(m_next)[:, None])
    return o + matmul(p.astype(v.dtype), v, precision=precision), m_next, l + p.sum(axis=-1)


def _aligned_kv_loader(k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, block_k: int):
    """load(block) -> K, V [block_k, D] of key block `block` (positions block * block_k + [0, block_k), all
    cached), with the block's alignment to the pages taken from the static sizes: what `load_kv_block` derives
    per lane with a division and a remainder is a loop-invariant lane constant. None when neither of block_k and
    page_size divides the other."""
    page_size = k_pages_ref.shape[2]
    if page_size % block_k and block_k % page_size:
        return None  # neither size divides the other: blocks straddle pages unevenly, the per-lane path stays
    if page_size % block_k == 0:  # the block lies in one page: one scalar page id, a contiguous slice of it

        def load(block):
            per_page = page_size // block_k
            if per_page == 1:
                page, first = page_table_ref[row, block], 0
            else:
                page, first = page_table_ref[row, lax.div(block, per_page)], lax.rem(block, per_page) * block_k
            index = (layer, page, pl.ds(first, block_k), kv_head, slice(None))
            return k_pages_ref[index], v_pages_ref[index]

        return load
    lanes = jnp.arange(block_k, dtype=jnp.int32)
    lane_page, lane_offset = lax.div(lanes, page_size), lax.rem(lanes, page_size)  # hoisted out of the loop

    def load(block):
        pages = page_table_ref[row, block * (block_k // page_size) + lane_page]
        index = (layer, pages, lane_offset, kv_head, slice(None))
        return k_pages_ref[index], v_pages_ref[index]

    return load


def key_block_step(q, k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, *, block_k: int, softmax_step,
                   key_end, visible):  # fmt: skip
    """step(block, carry, masked) for `loop_key_blocks`: the tile q [M, D] against key block `block` of a row's
    pages, folded into the softmax state by softmax_step. Unmasked blocks hold only visible cached keys (read
    through `_aligned_kv_loader` where the sizes allow); in a masked block, lanes at or past key_end re-read its
    last key, and scores where visible(positions) [M or 1, block_k] is False become -inf."""
    precision = dot_precision(q.dtype)
    load_aligned = _aligned_kv_loader(k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, block_k)

    def step(block, carry, masked):
        positions = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        if load_aligned is not None and not masked:
            k, v = load_aligned(block)
        else:
            lanes = jnp.minimum(positions, key_end - 1) if masked else positions
            k, v = load_kv_block(k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, lanes)
        scores = matmul(q, k, transpose_b=True, precision=precision)  # [M, block_k], unscaled
        if masked:
            scores = jnp.where(visible(positions), scores, -jnp.inf)
        return softmax_step(carry, scores, v, precision)

    return step


@dataclasses.dataclass(frozen=True)
class PrefixTuning:
    """Tiles of the prefix pass: tile_rows query rows a program (block_q queries x the GQA group padded to a power
    of two; at least 16 rows, a dot's minimum), block_k keys a step, and the Triton compiler's warps and stages."""

    tile_rows: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2


# By itemsize. bf16: the fastest of the 16-point sweep (tile rows 64/128 x block_k 32/64 x 4/8 warps x 2/3 stages)
# on the H200 at an 8192-token chunk, 4B heads, in one-kernel flash attention over the pages: 1.69 ms, 41.3% of the
# bf16 roofline, against 4.00 ms (17.4%) at (64, 32) (`tools/bench_attention.py --kernel prefill --sweep` times the
# grid on the prefix pass). fp32: the largest tiles that compile without register spills; at bf16's 128 rows x
# block_k 64 an fp32 program asks for 288 KiB of shared memory, over the H200's 227 KiB.
PREFIX_TUNING = {2: PrefixTuning(), 4: PrefixTuning(tile_rows=32, block_k=16)}


def prefix_tuning(dtype) -> PrefixTuning:
    """The measured prefix-pass tiles for q's dtype."""
    return PREFIX_TUNING[min(jnp.dtype(dtype).itemsize, 4)]


def _prefix_kernel(layer_ref, start_ref, page_table_ref, q_ref, lse_ref, o_chunk_ref, k_pages_ref, v_pages_ref,
                   o_ref, *, block_k: int):  # fmt: skip
    row, kv_head = pl.program_id(0), pl.program_id(1)
    start, layer = start_ref[row], layer_ref[0]

    @pl.when(start > 0)
    def _():
        block_q, group, dim = q_ref.shape
        q = q_ref[...].reshape(block_q * group, dim)  # tile row r: query r // group, head r % group
        lse = lse_ref[...].reshape(block_q * group)
        carry = (
            o_chunk_ref[...].reshape(block_q * group, dim).astype(jnp.float32),  # o_ref's buffer (aliased)
            lse * LOG2_E,
            jnp.ones_like(lse),
        )
        softmax_step = functools.partial(prefill_softmax_step, scale=dim**-0.5)
        step = key_block_step(q, k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, block_k=block_k,
                              softmax_step=softmax_step, key_end=start,
                              visible=lambda positions: (positions < start)[None, :])  # fmt: skip
        o, _, l = loop_key_blocks(carry, 0, pl.cdiv(start, block_k), lax.div(start, block_k), step)
        o_ref[...] = normalise(o, l).reshape(block_q, group, dim).astype(o_ref.dtype)


def prefix_merge_pallas(q, o_chunk, lse_chunk, k_pages, v_pages, layer, page_table, start, *, interpret=False,
                        tuning: PrefixTuning | None = None):  # fmt: skip
    """Fold the paged prefix (positions < start[p]) into the chunk part (o_chunk [P, T, H, D], lse_chunk
    [P, T, H] fp32), in place where the shapes need no padding. tuning: None takes `prefix_tuning(q.dtype)`."""
    rows, chunk, heads, dim = q.shape
    kv_heads = k_pages.shape[3]
    group = heads // kv_heads
    tuning = tuning or prefix_tuning(q.dtype)
    group_padded = pl.next_power_of_2(group)  # Triton tensors
    block_q = max(tuning.tile_rows // group_padded, pl.cdiv(16, group_padded))
    chunk_padded = pl.cdiv(chunk, block_q) * block_q
    tiled = (rows, chunk_padded, kv_heads, group_padded)

    def tile_layout(x):  # [P, T, H, ...] -> [P, T', KV, G', ...]; a reshape only when nothing needs padding
        x = x.reshape(rows, chunk, kv_heads, group, *x.shape[3:])
        return x if x.shape[:4] == tiled else pad_to(x, tiled + x.shape[4:])

    num_q_blocks = chunk_padded // block_q
    tile = pl.BlockSpec((None, block_q, None, group_padded, dim), lambda p, h, i: (p, i, h, 0, 0))
    lse_tile = pl.BlockSpec((None, block_q, None, group_padded), lambda p, h, i: (p, i, h, 0))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_prefix_kernel, block_k=tuning.block_k),
        grid=(rows, kv_heads, num_q_blocks),
        in_specs=[whole, whole, whole, tile, lse_tile, tile, whole, whole],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(tiled + (dim,), o_chunk.dtype),
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="prefill_prefix_merge",
    )(jnp.asarray(layer, jnp.int32).reshape(1), start, page_table, tile_layout(q),
      tile_layout(lse_chunk.astype(jnp.float32)), tile_layout(o_chunk), k_pages, v_pages)  # fmt: skip
    return out[:, :chunk, :, :group].reshape(rows, chunk, heads, dim)


def prefill_attention_pallas(q, k, v, k_pages, v_pages, layer, page_table, start, lengths, *, interpret=False,
                             tuning: PrefixTuning | None = None, tokamax: TokamaxConfig = TOKAMAX_CONFIG):  # fmt: skip
    """`prefill_attention_ref` as the chunk part and the prefix pass (tuning: its tiles, None for the measured
    ones). The chunk part is tokamax's kernel (at `tokamax`) for 2-byte dtypes on a GPU, and `chunk_attention_ref`
    in interpret mode and for 4-byte dtypes, where tokamax's wgmma would round to TF32."""
    del lengths  # the chunk part's padding queries see only their own chunk's keys; nobody reads them
    if jnp.dtype(q.dtype).itemsize == 2 and not interpret:
        o_chunk, lse = chunk_attention_tokamax(q, k, v, config=tokamax)
    else:
        o_chunk, lse = chunk_attention_ref(q, k, v)
    return prefix_merge_pallas(q, o_chunk, lse, k_pages, v_pages, layer, page_table, start, interpret=interpret,
                               tuning=tuning)  # fmt: skip
