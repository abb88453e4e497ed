"""Prefill attention in two parts: the chunk over its own keys (a library flash kernel), then the paged prefix.

Math (the same as `prefill_attention.paged_prefill_attention_ref`): the query at chunk index i of row p sits at
position start[p] + i and attends to the cached positions j < start[p] (the prefix, in the pages) and to the
chunk's own keys at indices j <= i. Softmax over both in fp32. Split by keys:
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
893 us, 77.9% of the bf16 roofline, against 1504 us (46.3%) for our one-kernel Triton version
(`paged_prefill_attention_pallas`), in the same command on the H200 (session 8, `tools/bench_attention.py
--kernel prefill --chunk 8192 --prefix 0 --dense-baselines`; 1k: 37.6 against 65.8 us; 2k: 102.0 against 133.3).
tokamax reads no pages, but the chunk's own keys need none: they are the projection's output, contiguous. Only
the prefix is paged, and it sees no causal mask (every prefix key precedes every query), so a simple Triton
pass reads it. Prompts that fit one chunk (start = 0 everywhere) skip that pass: its programs return at once
and the chunk part's output, which the pass updates in place (input/output aliasing), is the result.

- `chunk_attention_tokamax(q, k, v) -> (o, lse)`: tokamax 0.0.17, sm90 config (block_q 64 per warpgroup,
  block_kv 64, 2 stages: at head_dim 256 the only one of the measured three that fits shared memory), bf16 or
  fp16. Imported when first called; `pip install 'qwen35-jax[gpu]'` installs it.
- `chunk_attention_ref(q, k, v) -> (o, lse)`: the same in pure JAX, which the CPU (interpret-mode) tests and
  fp32 use.
- `prefix_merge_pallas(...)`: the prefix pass (Triton lowering; `interpret=True` on the CPU).
- `prefill_attention_ref` / `prefill_attention_pallas`: the whole attention, beside each other.

Numerics: tokamax rounds o_c to the model dtype and keeps lse in fp32; a row with a prefix is then folded in
fp32 and rounded once more, so it is within about two bf16 roundings of the exact result (one when start = 0,
as the one-kernel version). The prefix pass's softmax is the one-kernel version's (`prefill_softmax_step`).
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
    gather_pages,
    loop_key_blocks,
    normalise,
    pad_to,
)
from qwen35_jax.kernels.prefill_attention import (
    LOG2_E,
    key_block_step,
    paged_prefill_attention_pallas,
    prefill_softmax_step,
    prefill_tiles,
)

# tokamax's sm90 kernel config: block_q is per consumer warpgroup (two of them: 128 query rows a CTA).
TOKAMAX_CONFIG = dict(block_q=64, block_kv=64, num_stages=2)


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
def tokamax_attention():
    """tokamax's Mosaic GPU flash attention op at TOKAMAX_CONFIG; ImportError saying what to do without it."""
    try:
        from tokamax._src.ops.attention import pallas_mosaic_gpu
    except ImportError as error:
        raise ImportError(
            "prefill attention in the pallas kernel set runs the chunk part on tokamax's Mosaic GPU kernel: "
            "install it (pip install 'qwen35-jax[gpu]'), or choose the one-kernel Triton version with "
            f"--kernels pallas+prefill_attention=triton ({error})"
        ) from error
    config = pallas_mosaic_gpu.ConfigSM90(**TOKAMAX_CONFIG)
    return pallas_mosaic_gpu.PallasMosaicGpuFlashAttention(config=config)


def chunk_attention_tokamax(q, k, v):
    """`chunk_attention_ref` on tokamax's Mosaic GPU flash kernel (Hopper; 2-byte dtypes)."""
    out, (m, l) = tokamax_attention()(q, k, v, is_causal=True, return_residuals=True)
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
# Grid (P, KV, T / block_q), the one-kernel version's tiles (a block's queries times the KV head's `group` query
# heads). A program of a row with start = 0 returns at once: its output tile aliases the chunk part's output,
# which is then the result. Otherwise it loads the chunk part's o and lse for its tile, walks the prefix's key
# blocks [0, cdiv(start, block_k)) with the one-kernel version's softmax step (only the last block is masked,
# at start), and writes the normalised result over the chunk part's output.


def _prefix_kernel(layer_ref, start_ref, page_table_ref, q_ref, lse_ref, o_chunk_ref, k_pages_ref, v_pages_ref,
                   o_ref, *, block_k: int, hoist_index: bool, exp2: bool):  # fmt: skip
    row, kv_head = pl.program_id(0), pl.program_id(1)
    start, layer = start_ref[row], layer_ref[0]

    @pl.when(start > 0)
    def _():
        block_q, group, dim = q_ref.shape
        q = q_ref[...].reshape(block_q * group, dim)
        lse = lse_ref[...].reshape(block_q * group)
        carry = (
            o_chunk_ref[...].reshape(block_q * group, dim).astype(jnp.float32),  # o_ref's buffer (aliased)
            lse * LOG2_E if exp2 else lse,
            jnp.ones_like(lse),
        )
        softmax_step = functools.partial(prefill_softmax_step, scale=dim**-0.5, exp2=exp2)
        step = key_block_step(q, k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, block_k=block_k,
                              hoist_index=hoist_index, softmax_step=softmax_step, key_end=start,
                              visible=lambda positions: (positions < start)[None, :])  # fmt: skip
        o, _, l = loop_key_blocks(carry, 0, pl.cdiv(start, block_k), lax.div(start, block_k), step)
        o_ref[...] = normalise(o, l).reshape(block_q, group, dim).astype(o_ref.dtype)


def prefix_merge_pallas(q, o_chunk, lse_chunk, k_pages, v_pages, layer, page_table, start, *, interpret=False,
                        block_q: int | None = None, block_k: int | None = None, num_warps: int = 8,
                        num_stages: int = 2, exp2: bool = True, hoist_index: bool = True):  # fmt: skip
    """Fold the paged prefix (positions < start[p]) into the chunk part (o_chunk [P, T, H, D], lse_chunk
    [P, T, H] fp32), in place where the shapes need no padding. Tiles as `paged_prefill_attention_pallas`:
    None takes PREFILL_TUNING's tile rows and block_k for q's dtype (fp32 needs its smaller tiles: at bf16's 128
    rows x block_k 64 an fp32 program asks for 288 KiB of shared memory, over the H200's 227 KiB)."""
    rows, chunk, heads, dim = q.shape
    kv_heads = k_pages.shape[3]
    group = heads // kv_heads
    group_padded, block_q, block_k = prefill_tiles(q.dtype, group, block_q, block_k)
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
        functools.partial(_prefix_kernel, block_k=block_k, hoist_index=hoist_index, exp2=exp2),
        grid=(rows, kv_heads, num_q_blocks),
        in_specs=[whole, whole, whole, tile, lse_tile, tile, whole, whole],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(tiled + (dim,), o_chunk.dtype),
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="prefill_prefix_merge",
    )(jnp.asarray(layer, jnp.int32).reshape(1), start, page_table, tile_layout(q),
      tile_layout(lse_chunk.astype(jnp.float32)), tile_layout(o_chunk), k_pages, v_pages)  # fmt: skip
    return out[:, :chunk, :, :group].reshape(rows, chunk, heads, dim)


def prefill_attention_pallas(q, k, v, k_pages, v_pages, layer, page_table, start, lengths, *, interpret=False,
                             chunk_attention=None, **prefix_options):  # fmt: skip
    """`prefill_attention_ref` as the chunk part (tokamax on a GPU; `chunk_attention_ref` in interpret mode and
    for 4-byte dtypes, where tokamax's wgmma would round to TF32) and the prefix pass."""
    del lengths  # the chunk part's padding queries see only their own chunk's keys; nobody reads them
    if chunk_attention is None:
        two_bytes = jnp.dtype(q.dtype).itemsize == 2
        chunk_attention = chunk_attention_tokamax if two_bytes and not interpret else chunk_attention_ref
    o_chunk, lse = chunk_attention(q, k, v)
    return prefix_merge_pallas(q, o_chunk, lse, k_pages, v_pages, layer, page_table, start, interpret=interpret,
                               **prefix_options)  # fmt: skip


def paged_prefill_attention_triton(q, k, v, k_pages, v_pages, layer, page_table, start, lengths, **options):
    """The one-kernel Triton version behind `prefill_attention_ref`'s signature: it reads the chunk's keys from
    the pages, where the caller has written them, so k and v go unused."""
    del k, v
    return paged_prefill_attention_pallas(q, k_pages, v_pages, layer, page_table, start, lengths, **options)
