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
CPU): the grid, tiling and numerics are in the notes above it, and so are its options for the CUDA-core work
per key block (exp2: a base-2 online softmax, the default; lazy_rescale: rescale the accumulator only when a
row's max grows by more than 2^8; hoist_index, the default: the page index of unmasked key blocks from
static sizes).
Its tiling defaults (PREFILL_TUNING: bf16 128 tile rows, block_k 64, 8 warps, 2 stages, heavy query blocks
first) are the fastest of the tuning grid on the H200 at 4B shapes (`tools/bench_attention.py --sweep` times
the grid).

tokamax (openxla/tokamax 0.0.17, the newest on PyPI, read from its wheel): a pure-Python wheel needing
jax >= 0.11.1, so it would install beside jax 0.11.2, but it pulls qwix, xprof, tensorboardx, pydantic,
jaxtyping and einshape. `tokamax.dot_product_attention` has Mosaic GPU (sm80/sm90/sm100) and Triton
flash kernels with GQA, head_dim 256, causal masks and per-query key ranges (`q_indices`, k_start/k_end),
which is enough for "query i at position start+i sees keys <= start+i". But every GPU implementation
raises NotImplementedError("Paged attention not supported") when given `paging_info`; only its XLA
`xla_chunked` path reads pages. Using it here would mean gathering each row's pages into a contiguous
[P, S, KV, D] K and V per layer and step (the copy the reference makes), then one tokamax call with
q_indices = start + arange(T) per row. Not adopted in that form: this kernel reads the pages in place.
Session 8 measured it on the dense causal problem (77.9% of the bf16 roofline at 8192 tokens against this
kernel's 46.3%) and adopted it without any gather: `chunk_attention.py` runs the chunk over its own keys
(contiguous, as projected) on tokamax and folds the paged prefix in with a pass built from this kernel's
pieces. This kernel stays as the `pallas+prefill_attention=triton` alternative.
"""

from __future__ import annotations

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
    empty_softmax_state,
    finite_max,
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
#
# Softmax options (`prefill_softmax_step`; keyword arguments of the wrapper, so a sweep can A/B them). Why
# they should help: at 8 warps the program's [128, 256] fp32 accumulator o lives in registers, and every
# key block the CUDA cores do per-score work ([128, block_k]: scale, subtract the max, exp, row max and sum,
# round to bf16) and per-accumulator work ([128, 256]: o *= correction, four times the per-score count at
# block_k 64) between the two tensor-core products of the block, on the same SM. Whether each pays is the
# sweep's to say (`tools/bench_attention.py --kernel prefill --chunk 8192 --prefix 0 --sweep --prefill-grid
# softmax`); exp2 and hoist_index are the defaults (measured faster, session 7), lazy_rescale is off (slower).
# - exp2 (default on): the softmax runs in the base-2 domain. The raw q.k scores are multiplied by
#   scale * log2(e) once (the multiply that `* scale` was, and it can fuse with the max subtraction into one
#   FMA), the running max m is kept in those units, and p and the correction are exp2(...). The Triton
#   lowering calls libdevice: __nv_exp2f is one ex2.approx (the special-function unit), __nv_expf is the
#   same ex2.approx behind a range reduction of about six more instructions (FMAs with log2(e) split in two
#   parts, a rounding to the integer part, a shift and a final multiply; read from CUDA 13.0's
#   libdevice.10.bc). The row max
#   is taken on the raw scores and scaled once per row (max commutes with a positive scale, rounding
#   included). l and o mean what they did: the result differs from exp's by the fp32 rounding of the
#   exponent arguments (~1e-6 relative per probability at the largest arguments), far inside both test
#   tolerances (measured in interpret mode: fp32 max |o - ref| 1.8e-6 with exp2, 2.0e-6 with exp).
# - lazy_rescale (default off; FlashAttention-4's conditional rescaling): o and l are rescaled only when some
#   tile row's block max exceeds its stored max by more than rescale_threshold (8 in log2 units, a factor
#   256); otherwise every row keeps its stale max, so p = exp2(s - m) <= 2^8: finite in fp32 and in bf16,
#   whose exponent range is fp32's, with the same 8-bit mantissa rounding at any magnitude. o and l always
#   share their row's max, so o / l at the end is the same quotient. The branch is a `lax.cond` per program
#   (Triton: scf.if) on "any row grows": it skips the [128, 256] multiply of o, and the per-row exp of the
#   correction, in blocks where no row's max grows by more than the threshold (with scores like the
#   benchmark's, N(0, 1) in natural units, every block after the first: the max over 8192 keys is only ~2
#   log2 units above the max over the first 64); when taken, every row is rescaled to its exact new max.
#   The price is the tile-wide reduction of that flag (a cross-warp reduction through shared memory) every
#   block, and a branch in the loop that Triton's software pipeline has to schedule around. The first block
#   always takes the branch (m = -inf); a row that has seen no visible key keeps m = -inf, o = 0, l = 0 in
#   both branches, since p = exp2(-inf - 0) = 0.
# - hoist_index (default on): the index work of an unmasked key block. `load_kv_block` turns each of the
#   block_k lanes into a page slot (position // page_size, a signed division) and an in-page offset
#   (position % page_size, a remainder) every block, before the page-id gather and the K/V addresses. In an
#   unmasked block the alignment is static: when block_k is a multiple of page_size (the 4B default: 64 over
#   pages of 16), a lane's slot is block * (block_k / page_size) + lane // page_size and its offset
#   lane % page_size, both lane constants computed once per program, so the block costs a scalar multiply
#   and a vector add before the gather, and the offset's share of the address is loop-invariant; when
#   page_size is a multiple of block_k the block lies in one page: one scalar page id and a contiguous
#   slice. The masked blocks keep the clamped per-lane path. The same keys are read: no change in results.
#   Looked at and left: `frontier` is already computed once per program, and the masked blocks (the
#   `jnp.minimum` clamp and the [M, block_k] compare and select) are about block_q / block_k + 1 of a
#   program's up to chunk / block_k blocks, too few to show in a sweep.


def _q_block(index, num_q_blocks: int, heavy_first: bool):
    """The query block a grid index works on: in order, or last block first (see `heavy_first`)."""
    return num_q_blocks - 1 - index if heavy_first else index


LOG2_E = math.log2(math.e)
# lazy_rescale keeps a stale row max until a block's max exceeds it by more than this (log2 units: a factor 256).
RESCALE_THRESHOLD = 8.0


def prefill_softmax_step(carry, scores, v, precision, *, scale: float, exp2: bool = True,
                         rescale_threshold: float | None = None):  # fmt: skip
    """Fold one key block into the running (o [M, D], m [M], l [M]). scores [M, block_k] are the raw q.k
    products in fp32 (not yet scaled), -inf where masked. exp2: m is kept in units of scale * log2(e) * q.k
    and exponentials are exp2; otherwise in units of scale * q.k with exp (`online_softmax_step` exactly
    when rescale_threshold is None). rescale_threshold (log2 units, any domain): rescale o and l only when
    some row's block max exceeds its stored max by more than this; None: every block (see the notes above).
    A row that has seen no visible key yet keeps m = -inf, l = 0, o = 0 (no NaN)."""
    if not exp2 and rescale_threshold is None:
        return online_softmax_step(carry, scores * scale, v, precision)
    factor, exp = (scale * LOG2_E, jnp.exp2) if exp2 else (scale, jnp.exp)
    o, m, l = carry
    block_max = scores.max(axis=-1) * factor  # = max of the scaled scores: rounding is monotone

    def rescale(o, m, l):
        m_next = jnp.maximum(m, block_max)
        correction = exp(m - finite_max(m_next))  # 0 for rows with m = -inf: their o and l are 0 anyway
        return correction[:, None] * o, m_next, correction * l

    if rescale_threshold is None:
        o, m, l = rescale(o, m, l)
    else:
        threshold = rescale_threshold if exp2 else rescale_threshold * math.log(2.0)
        grows = (block_max > m + threshold).astype(jnp.int32).max() > 0  # m = -inf: any visible key grows it
        o, m, l = lax.cond(grows, rescale, lambda o, m, l: (o, m, l), o, m, l)
    p = exp(scores * factor - finite_max(m)[:, None])  # <= 2^threshold with a stale m
    return o + matmul(p.astype(v.dtype), v, precision=precision), m, l + p.sum(axis=-1)


def _aligned_kv_loader(k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, block_k: int):
    """load(block) -> K, V [block_k, D] of key block `block` (positions block * block_k + [0, block_k), all
    cached), with the block's alignment to the pages taken from the static sizes (`hoist_index`): what
    `load_kv_block` derives per lane with a division and a remainder is a loop-invariant lane constant.
    None when neither of block_k and page_size divides the other."""
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


def key_block_step(q, k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, *, block_k: int,
                   hoist_index: bool, softmax_step, key_end, visible):  # fmt: skip
    """step(block, carry, masked) for `loop_key_blocks`: the tile q [M, D] against key block `block` of a row's
    pages, folded into the softmax state by softmax_step. Unmasked blocks hold only visible cached keys (read
    through `_aligned_kv_loader` with hoist_index); in a masked block, lanes at or past key_end re-read its last
    key, and scores where visible(positions) [M or 1, block_k] is False become -inf. Shared by the one-kernel
    version and the prefix pass of `chunk_attention`."""
    precision = dot_precision(q.dtype)
    load_aligned = (_aligned_kv_loader(k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, block_k)
                    if hoist_index else None)  # fmt: skip

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


def prefill_tiles(dtype, group: int, block_q: int | None, block_k: int | None) -> tuple[int, int, int]:
    """(padded group, block_q, block_k) of a prefill tile for q's dtype: None takes PREFILL_TUNING's tile rows and
    block_k. The group is padded to a power of two (Triton tensors), and a tile keeps >= 16 rows (a dot's minimum)."""
    tile_rows, default_block_k = PREFILL_TUNING[min(jnp.dtype(dtype).itemsize, 4)]
    group_padded = pl.next_power_of_2(group)
    block_q = max(block_q or tile_rows // group_padded, pl.cdiv(16, group_padded))
    return group_padded, block_q, block_k or default_block_k


def _prefill_kernel(layer_ref, start_ref, lengths_ref, page_table_ref, q_ref, k_pages_ref, v_pages_ref, o_ref,
                    *, block_k: int, num_q_blocks: int, heavy_first: bool, hoist_index: bool,
                    softmax_step):  # fmt: skip
    row, kv_head = pl.program_id(0), pl.program_id(1)
    q_block = _q_block(pl.program_id(2), num_q_blocks, heavy_first)
    block_q, group, dim = q_ref.shape
    start, length, layer = start_ref[row], lengths_ref[row], layer_ref[0]
    q = q_ref[...].reshape(block_q * group, dim)  # tile row r: query r // group, head r % group
    first_query = q_block * block_q
    block_end = start + jnp.minimum(first_query + block_q, length)  # one past the last key this block sees
    chunk_end = start + length
    # Each tile row's last visible key: its own position, or the chunk's last valid key for padding queries.
    frontier = jnp.minimum(start + first_query + lax.div(jnp.arange(block_q * group, dtype=jnp.int32), group),
                           chunk_end - 1)  # fmt: skip

    step = key_block_step(q, k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, block_k=block_k,
                          hoist_index=hoist_index, softmax_step=softmax_step, key_end=block_end,
                          visible=lambda positions: positions[None, :] <= frontier[:, None])  # fmt: skip

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
                                   num_stages: int = 2, heavy_first: bool = True, exp2: bool = True,
                                   lazy_rescale: bool = False, rescale_threshold: float = RESCALE_THRESHOLD,
                                   hoist_index: bool = True):  # fmt: skip
    """Pallas version of `paged_prefill_attention_ref` (same arguments; valid queries give the same result,
    padding queries give finite values nobody reads). block_q (queries per program), block_k (keys per
    step), num_warps and num_stages tune it; None takes PREFILL_TUNING's value for q's dtype.
    heavy_first maps the grid's query-block axis backwards, so the blocks that see the most keys (the
    chunk's last) start first and the short ones fill the tail of the causal triangle, as flash-attention
    schedules causal work: 5% faster at an 8192-token chunk on the H200, the default.
    exp2 runs the online softmax in base 2 (the default; False: natural exp as before); lazy_rescale
    rescales the accumulator only when a row's max grows by more than rescale_threshold (log2 units, a
    factor 2^8 by default), per program (off by default). hoist_index loads the unmasked key blocks with
    page ids and in-page offsets derived from the static block and page sizes (same keys, same result; the
    default). H200, 8192-token chunk (session 7, `tools/bench_attention.py --sweep --prefill-grid softmax`):
    exp 1601.8 us (43.5% of the bf16 roofline), exp2 1511.7 us (46.0%), exp2 + hoist_index 1494.6 us (46.6%);
    lazy_rescale slower in every combination (docs/kernels.md). All three are described in the notes above
    `prefill_softmax_step`."""
    rows, chunk, heads, dim = q.shape
    kv_heads = k_pages.shape[3]
    group = heads // kv_heads
    group_padded, block_q, block_k = prefill_tiles(q.dtype, group, block_q, block_k)
    chunk_padded = pl.cdiv(chunk, block_q) * block_q
    qg = pad_to(q.reshape(rows, chunk, kv_heads, group, dim), (rows, chunk_padded, kv_heads, group_padded, dim))
    num_q_blocks = chunk_padded // block_q
    tile = pl.BlockSpec((None, block_q, None, group_padded, dim),
                        lambda p, h, i: (p, _q_block(i, num_q_blocks, heavy_first), h, 0, 0))  # fmt: skip
    whole = pl.BlockSpec(memory_space=pl.ANY)
    softmax_step = functools.partial(prefill_softmax_step, scale=dim**-0.5, exp2=exp2,
                                     rescale_threshold=rescale_threshold if lazy_rescale else None)  # fmt: skip
    out = pl.pallas_call(
        functools.partial(
            _prefill_kernel,
            block_k=block_k,
            num_q_blocks=num_q_blocks,
            heavy_first=heavy_first,
            hoist_index=hoist_index,
            softmax_step=softmax_step,
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
