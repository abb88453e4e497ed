"""Prefill attention over a paged prefix plus the current chunk: causal, ragged over rows, GQA.

Math: the query at chunk index i of row p has absolute position start[p] + i and attends to every cached
position j <= start[p] + i of its own row (prefix pages and this chunk, whose K/V are already written).
Scores and softmax in fp32; probabilities rounded to the model dtype before the value product.

Layouts:
    q           [P, T, H, D] model dtype (after q_norm and RoPE)
    k_pages     [L, N, page_size, KV, D];  v_pages the same;  layer int32 scalar
    page_table  [P, W] int32;  start [P] int32 tokens already cached before this chunk;  lengths [P] valid
                tokens of the chunk (queries past it produce values nobody reads)
Returns o [P, T, H, D] in q's dtype.

`paged_prefill_attention_pallas` is the Pallas GPU kernel (Triton lowering; `interpret=True` runs it on the
CPU): the grid, tiling and numerics are in the notes above it. Its defaults (PREFILL_TUNING: bf16 128 tile
rows, block_k 64, 8 warps, 2 stages, heavy query blocks first) are the fastest of the tuning grid on the H200 at
4B shapes (`tools/bench_attention.py --sweep` times the grid).

tokamax (openxla/tokamax 0.0.17, the newest on PyPI, read from its wheel): a pure-Python wheel needing
jax >= 0.11.1, so it would install beside jax 0.11.2, but it pulls qwix, xprof, tensorboardx, pydantic,
jaxtyping and einshape. `tokamax.dot_product_attention` has Mosaic GPU (sm80/sm90/sm100) and Triton
flash kernels with GQA, head_dim 256, causal masks and per-query key ranges (`q_indices`, k_start/k_end),
which is enough for "query i at position start+i sees keys <= start+i". But every GPU implementation
raises NotImplementedError("Paged attention not supported") when given `paging_info`; only its XLA
`xla_chunked` path reads pages. Using it here would mean gathering each row's pages into a contiguous
[P, S, KV, D] K and V per layer and step (the copy the reference makes), then one tokamax call with
q_indices = start + arange(T) per row. Not adopted: this kernel reads the pages in place. It is worth an
A/B on the GPU for long chunks over short prefixes, where the gather is small next to the FLOPs and the
warp-specialised Hopper kernel (TMA + wgmma) should beat the Triton lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qwen35_jax.kernels.decode_attention import (
    attend,
    dot_precision,
    empty_softmax_state,
    gather_pages,
    load_kv_block,
    loop_key_blocks,
    matmul,
    normalise,
    online_softmax_step,
    pad_to,
)


def paged_prefill_attention_ref(q, k_pages, v_pages, layer, page_table, start, lengths):
    k = gather_pages(k_pages, layer, page_table)
    v = gather_pages(v_pages, layer, page_table)
    query_pos = start[:, None] + jnp.arange(q.shape[1])[None, :]  # [P, T]
    mask = jnp.arange(k.shape[1])[None, None, :] <= query_pos[:, :, None]
    return attend(q, k, v, mask, q.shape[-1] ** -0.5)


# ---- Pallas GPU kernel (Triton lowering) -------------------------------------------------------------------
#
# Grid (P, KV, T / block_q): one program per (row, KV head, block of block_q queries). Its tile is the
# block's queries times the `group` query heads of that KV head, [block_q * group, D] (GQA packing: K/V
# of a head are read once for all its query heads). Query i of the block sits at position
# start + q_block * block_q + i. The program walks key blocks from position 0 to its causal frontier, the
# position of its last valid query; key blocks wholly at or before its first query's position need no
# mask, the rest (at most about block_q / block_k + 1 blocks) are masked per query. Keys are gathered
# token by token through the page table (any page size; a block may span pages), exactly as the decode
# kernel does, and nothing past start + lengths is read.
#
# Queries past lengths[p] (chunk padding) see only the chunk's valid keys; a query block wholly past it,
# and every query of a padding row (lengths 0), skips all key blocks and writes 0. The reference gives
# those unread positions other finite values, so tests compare valid queries only.
#
# Occupancy: P * KV * T / block_q programs, few for a short chunk (a 16-token chunk after a 4k prefix runs
# 4 programs, each reading the whole prefix). There is no split over keys as in decode yet; such chunks
# are the ones the stream overlap of DESIGN section 6 runs beside decode.
#
# Numerics: the flash / online softmax of `decode_attention` (scores and softmax state in fp32, exp(s - m)
# rounded to the model dtype before the value product, divided by the fp32 sum at the end); about one
# bf16 ulp from the reference in bf16, summation order (~1e-6) in fp32.


def _q_block(index, num_q_blocks: int, heavy_first: bool):
    """The query block a grid index works on: in order, or last block first (see `heavy_first`)."""
    return num_q_blocks - 1 - index if heavy_first else index


def _prefill_kernel(layer_ref, start_ref, lengths_ref, page_table_ref, q_ref, k_pages_ref, v_pages_ref, o_ref,
                    *, block_k: int, scale: float, num_q_blocks: int, heavy_first: bool):  # fmt: skip
    row, kv_head = pl.program_id(0), pl.program_id(1)
    q_block = _q_block(pl.program_id(2), num_q_blocks, heavy_first)
    block_q, group, dim = q_ref.shape
    start, length, layer = start_ref[row], lengths_ref[row], layer_ref[0]
    q = q_ref[...].reshape(block_q * group, dim)  # tile row r: query r // group, head r % group
    precision = dot_precision(q.dtype)
    first_query = q_block * block_q
    block_end = start + jnp.minimum(first_query + block_q, length)  # one past the last key this block sees
    chunk_end = start + length
    # Each tile row's last visible key: its own position, or the chunk's last valid key for padding queries.
    frontier = jnp.minimum(start + first_query + lax.div(jnp.arange(block_q * group, dtype=jnp.int32), group),
                           chunk_end - 1)  # fmt: skip

    def step(block, carry, masked):
        positions = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        if masked:  # lanes past block_end re-read its last key and are masked out below
            positions = jnp.minimum(positions, block_end - 1)
        k, v = load_kv_block(k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, positions)
        scores = matmul(q, k, transpose_b=True, precision=precision) * scale  # [block_q * group, block_k]
        if masked:
            visible = (block * block_k + jnp.arange(block_k))[None, :] <= frontier[:, None]
            scores = jnp.where(visible, scores, -jnp.inf)
        return online_softmax_step(carry, scores, v, precision)

    num_blocks = jnp.where(first_query < length, pl.cdiv(block_end, block_k), 0)
    # Keys at or before the block's first query position are visible to every tile row.
    first_masked = lax.div(start + first_query + 1, block_k)
    carry = loop_key_blocks(empty_softmax_state(block_q * group, dim), 0, num_blocks, first_masked, step)
    o, _, l = carry
    o_ref[...] = normalise(o, l).reshape(block_q, group, dim).astype(o_ref.dtype)


# Default (tile rows, block_k) by itemsize, with 8 warps and 2 stages. bf16: the fastest of the 16-point sweep
# (tile rows 64/128 x block_k 32/64 x 4/8 warps x 2/3 stages) on the H200 at a 8192-token chunk, 4B heads:
# 1.69 ms, 41.3% of the bf16 roofline, against 4.00 ms (17.4%) for the session-2 default (64, 32)
# (`tools/bench_attention.py --kernel prefill --chunk 8192 --prefix 0 --sweep`, docs/kernels.md).
# fp32: the largest tiles that compiled without register spills (offline), not tuned on a GPU.
# heavy_first (session 4, same command): 1.60 ms, 43.5%, against 1.69 ms (41.2%) walking the blocks in order.
PREFILL_TUNING = {2: (128, 64), 4: (32, 16)}


def paged_prefill_attention_pallas(q, k_pages, v_pages, layer, page_table, start, lengths, *, interpret=False,
                                   block_q: int | None = None, block_k: int | None = None, num_warps: int = 8,
                                   num_stages: int = 2, heavy_first: bool = True):  # fmt: skip
    """Pallas version of `paged_prefill_attention_ref` (same arguments; valid queries give the same result,
    padding queries give finite values nobody reads). block_q (queries per program), block_k (keys per
    step), num_warps and num_stages tune it; None takes PREFILL_TUNING's value for q's dtype.
    heavy_first maps the grid's query-block axis backwards, so the blocks that see the most keys (the
    chunk's last) start first and the short ones fill the tail of the causal triangle, as flash-attention
    schedules causal work: 5% faster at an 8192-token chunk on the H200, the default."""
    tile_rows, default_block_k = PREFILL_TUNING[min(jnp.dtype(q.dtype).itemsize, 4)]
    rows, chunk, heads, dim = q.shape
    kv_heads = k_pages.shape[3]
    group = heads // kv_heads
    group_padded = pl.next_power_of_2(group)  # Triton tensors have power-of-two sizes
    block_q = max(block_q or tile_rows // group_padded, pl.cdiv(16, group_padded))  # a dot needs >= 16 rows
    block_k = block_k or default_block_k
    chunk_padded = pl.cdiv(chunk, block_q) * block_q
    qg = pad_to(q.reshape(rows, chunk, kv_heads, group, dim), (rows, chunk_padded, kv_heads, group_padded, dim))
    num_q_blocks = chunk_padded // block_q
    tile = pl.BlockSpec((None, block_q, None, group_padded, dim),
                        lambda p, h, i: (p, _q_block(i, num_q_blocks, heavy_first), h, 0, 0))  # fmt: skip
    whole = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(
            _prefill_kernel, block_k=block_k, scale=dim**-0.5, num_q_blocks=num_q_blocks, heavy_first=heavy_first
        ),
        grid=(rows, kv_heads, num_q_blocks),
        in_specs=[whole, whole, whole, whole, tile, whole, whole],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_prefill_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), start, lengths, page_table, qg, k_pages, v_pages)
    return out[:, :chunk, :, :group].reshape(rows, chunk, heads, dim)
