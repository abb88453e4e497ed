"""Paged decode attention: one query token per row against that row's pages, GQA.

Math: o[b, h] = softmax_j( q[b, h] . k[b, j, h // group] * scale ) v[b, j, h // group] over j < lengths[b],
scores and softmax in fp32, probabilities rounded to the model dtype before the value product (as HF eager).

Layouts:
    q           [B', H, D]  model dtype (after q_norm and RoPE); B' >= B: the decode rows are the first B (a unified
                step's tokens, prefill ones after them, are passed whole, so that no slice is copied out for the call)
    k_pages     [L, N, page_size, KV, D] model dtype (the current token's K/V already written);  same for v
    layer       int32 scalar: which full-attention layer of the pool
    page_table  [B, W] int32: page ids of each row in order (unused entries point at the trash page 0)
    lengths     [B] int32: tokens in the cache for each row, the current one included
    gate        [B', H, D] model dtype, optional: the output gate (Qwen3.5's attention output is o * sigmoid(gate)),
                its first B rows the decode rows' as q's
Returns o [B, H, D] in q's dtype (gated when a gate is given: `output_gate`).

`paged_decode_attention_pallas` is the Pallas GPU kernel (Triton lowering; `interpret=True` runs it on the
CPU): grid, split-K and numerics are in the notes above it, its tiles in `DecodeAttentionTuning`. The helpers
after those notes (the paged K/V gather, the key-block loop, the online-softmax state) are shared with the
prefill attention's prefix pass (`chunk_attention.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qwen35_jax.kernels.device import sm_count, start_dependents


def gather_pages(pages: jax.Array, layer, page_table: jax.Array) -> jax.Array:
    """[L, N, ps, KV, D] pages of `layer`, rows by page_table [R, W] -> [R, W * ps, KV, D]."""
    rows, width = page_table.shape
    gathered = pages[layer][page_table]  # [R, W, ps, KV, D]
    return gathered.reshape(rows, width * pages.shape[2], *pages.shape[3:])


def attend(q, k, v, mask, scale):
    """q [R, Q, H, D]; k, v [R, S, KV, D]; mask [R, Q, S] -> [R, Q, H, D] (GQA by head // group)."""
    group = q.shape[2] // k.shape[2]
    qg = q.reshape(q.shape[0], q.shape[1], k.shape[2], group, q.shape[3])
    scores = jnp.einsum("rqkgd,rskd->rkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("rkgqs,rskd->rqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def output_gate(out, gate):
    """Qwen3.5's gated attention output: out * sigmoid(gate), the sigmoid in fp32 rounded to the model dtype and
    the product rounded once (HF's order; the exact product of two bf16 values fits fp32)."""
    sigmoid = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    return (out.astype(jnp.float32) * sigmoid.astype(jnp.float32)).astype(out.dtype)


def paged_decode_attention_ref(q, k_pages, v_pages, layer, page_table, lengths, gate=None):
    q = q[: lengths.shape[0]]
    k = gather_pages(k_pages, layer, page_table)
    v = gather_pages(v_pages, layer, page_table)
    mask = (jnp.arange(k.shape[1])[None, :] < lengths[:, None])[:, None, :]
    out = attend(q[:, None], k, v, mask, q.shape[-1] ** -0.5)[:, 0]
    return out if gate is None else output_gate(out, gate[: out.shape[0]].reshape(out.shape))


# ---- Pallas GPU kernel (Triton lowering) -------------------------------------------------------------------
#
# Grid (B, KV, splits): one program per (row, KV head, split of the row's keys). Its tile holds the `group`
# query heads of that KV head, padded to 16 rows (the smallest tensor-core M), so K/V of a head are read
# once for all the heads that share it. The padding is a masked load and store of the group's rows when the
# group is a power of two (a block shape Triton takes): no padded copy of q, no slice of the output. The
# row's used key blocks, cdiv(lengths[b], block_k), are dealt out evenly to the splits (flash-decoding:
# small batches fill the GPU); each split writes an unnormalised partial output with its running max and
# denominator. With an output gate and a power-of-two group, a second kernel (`_merge_kernel`, grid (B, KV))
# combines the splits and applies the gate, where XLA took three kernels a layer for the merge and the gate
# (exp, the denominators' sum, the weighted sum with the gate's multiply: ~1.2 us each at batch 1 on the H100);
# otherwise `merge_splits` combines them in XLA.
# Keys are gathered token by token: position j of row b lives at page page_table[b, j // page_size],
# offset j % page_size, so any page size works and a block may span pages. Lanes of the last block past
# lengths[b] re-read the row's last token (an L1 hit) and are masked out of the softmax: nothing past the
# row's length is read, neither the tail of its last page nor the unused page-table entries.
#
# Numerics (flash / online softmax): scores in fp32, a running max m and denominator l per query row in
# fp32, exp(scores - m) rounded to the model dtype before the value product (fp32 accumulation), divided
# by l at the end. The reference rounds the *normalised* probabilities instead; in bf16 both round each
# probability to 8 mantissa bits, so outputs differ by about one bf16 ulp. In fp32 the two agree to
# summation order (~1e-6). fp32 dots run in IEEE fp32 (no TF32), as the reference does on the CPU.


def dot_precision(dtype) -> lax.Precision | None:
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def matmul(a, b, *, transpose_b: bool = False, precision=None):
    """a [M, K] @ b [K, N] (or b [N, K] transposed) with fp32 accumulation, as a tensor-core dot."""
    contract = 1 if transpose_b else 0
    return lax.dot_general(a, b, (((1,), (contract,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)  # fmt: skip


def load_kv_block(k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, positions):
    """K and V [block_k, D] of one KV head of `row` at token `positions` [block_k] (all cached tokens)."""
    page_size = k_pages_ref.shape[2]
    pages = page_table_ref[row, lax.div(positions, page_size)]
    index = (layer, pages, lax.rem(positions, page_size), kv_head, slice(None))
    return k_pages_ref[index], v_pages_ref[index]


def finite_max(m):
    """A running max with -inf (rows that saw no visible key) as 0, so that exp(-inf - m) is 0 and never NaN."""
    return lax.select(m == -jnp.inf, lax.full_like(m, 0.0), m)


def online_softmax_step(carry, scores, v, precision):
    """Fold one key block into the running (o [M, D], m [M], l [M]); scores [M, block_k] fp32 with -inf where
    masked. A row that has seen no visible key yet keeps m = -inf, l = 0, o = 0 (no NaN)."""
    o, m, l = carry
    m_next = jnp.maximum(m, scores.max(axis=-1))
    m_safe = finite_max(m_next)
    correction = jnp.exp(m - m_safe)
    p = jnp.exp(scores - m_safe[:, None])
    l_next = correction * l + p.sum(axis=-1)
    o_next = correction[:, None] * o + matmul(p.astype(v.dtype), v, precision=precision)
    return o_next, m_next, l_next


def empty_softmax_state(rows: int, dim: int):
    return (
        jnp.zeros((rows, dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def normalise(o, l):
    """o / l per row; rows that saw no key (l = 0) give 0."""
    return o / lax.select(l > 0, l, lax.full_like(l, 1.0))[..., None]


def pad_to(x, shape):
    """Zero-pad x at the end of each axis up to `shape`."""
    return lax.pad(x, jnp.zeros((), x.dtype), [(0, n - d, 0) for d, n in zip(x.shape, shape, strict=True)])


def loop_key_blocks(carry, first, last, first_masked, step):
    """Run step(block, carry, masked) over blocks [first, last): blocks before first_masked need no mask."""
    middle = jnp.clip(first_masked, first, last)
    carry = lax.fori_loop(first, middle, functools.partial(step, masked=False), carry)
    return lax.fori_loop(middle, last, functools.partial(step, masked=True), carry)


def load_rows(ref, rows: int):
    """ref's block [n, ...] as [rows, ...] (rows >= n), the rows past n zero: a masked load."""
    if ref.shape[0] == rows:
        return ref[...]
    valid = (jnp.arange(rows) < ref.shape[0]).reshape(rows, *[1] * (len(ref.shape) - 1))
    return plgpu.load(ref.at[pl.ds(0, rows)], mask=valid, other=0)


def store_rows(ref, value) -> None:
    """value [rows, ...] into ref's block [n, ...] (n <= rows): its first n rows, by a masked store."""
    rows = value.shape[0]
    if ref.shape[0] == rows:
        ref[...] = value
        return
    valid = (jnp.arange(rows) < ref.shape[0]).reshape(rows, *[1] * (value.ndim - 1))
    plgpu.store(ref.at[pl.ds(0, rows)], value, mask=valid)


def _decode_kernel(layer_ref, lengths_ref, page_table_ref, q_ref, k_pages_ref, v_pages_ref, o_ref, m_ref, l_ref,
                   *, block_k: int, num_splits: int, scale: float, rows: int, early_launch: bool):  # fmt: skip
    row, kv_head, split = start_dependents(pl.program_id(0), early_launch), pl.program_id(1), pl.program_id(2)
    length, layer = lengths_ref[row], layer_ref[0]
    q = load_rows(q_ref, rows)  # [rows, D]: this KV head's query heads, zero-padded
    precision = dot_precision(q.dtype)
    num_blocks = pl.cdiv(length, block_k)
    per_split = pl.cdiv(num_blocks, num_splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)

    def step(block, carry, masked):
        positions = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        if masked:  # the row's last block: lanes past the end re-read its last token and are masked out
            positions = jnp.minimum(positions, length - 1)
        k, v = load_kv_block(k_pages_ref, v_pages_ref, layer, page_table_ref, row, kv_head, positions)
        scores = matmul(q, k, transpose_b=True, precision=precision) * scale  # [rows, block_k] fp32
        if masked:
            scores = jnp.where((block * block_k + jnp.arange(block_k) < length)[None, :], scores, -jnp.inf)
        return online_softmax_step(carry, scores, v, precision)

    carry = empty_softmax_state(*q.shape)
    o, m, l = loop_key_blocks(carry, first, last, lax.div(length, block_k), step)
    for ref, value in ((o_ref, o), (m_ref, m), (l_ref, l)):
        store_rows(ref, value)


def merge_splits(o, m, l):
    """Combine split partials: o [S, ..., D] unnormalised, m and l [S, ...] -> [..., D] fp32."""
    m_max = m.max(axis=0)
    m_max = lax.select(m_max == -jnp.inf, lax.full_like(m_max, 0.0), m_max)
    weight = jnp.exp(m - m_max)  # empty splits (m = -inf) weigh 0
    return normalise((o * weight[..., None]).sum(axis=0), (l * weight).sum(axis=0))


def decode_splits(batch: int, kv_heads: int, max_tokens: int, block_k: int, num_sms: int | None = None) -> int:
    """Splits per row so that about two programs per SM (num_sms: the device's) run, at most 16 and no more than
    key blocks."""
    wanted = pl.cdiv(2 * (num_sms or sm_count()), batch * kv_heads)
    return max(1, min(wanted, 16, pl.cdiv(max_tokens, block_k)))


@dataclasses.dataclass(frozen=True)
class DecodeAttentionTuning:
    """Tiles of the decode kernel: block_k tokens per key block, num_splits splits of a row's keys (None:
    `decode_splits`, about two programs per SM), and the Triton compiler's warps and stages."""

    block_k: int = 32
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3


# By itemsize. bf16: the fastest of the 12-point sweep on the H200 at batch 64, 4B heads, at both context 1024
# (89.5 us, 70.0% of the memory roofline; block_k 64, 4 warps, 2 stages took 98.2 us) and 4096 (274 us, 91.2%;
# 300 us) (`tools/bench_attention.py --kernel decode --sweep`, docs/kernels.md). fp32: the largest that compiled
# without register spills; fp32 dots are FMA loops over twice the bytes, so half the block.
DECODE_TUNING = {2: DecodeAttentionTuning(), 4: DecodeAttentionTuning(num_warps=8, num_stages=2)}


def decode_attention_tuning(dtype) -> DecodeAttentionTuning:
    """The measured decode tiles for q's dtype."""
    return DECODE_TUNING[min(jnp.dtype(dtype).itemsize, 4)]


def paged_decode_attention_pallas(q, k_pages, v_pages, layer, page_table, lengths, gate=None, *, interpret=False,
                                  tuning: DecodeAttentionTuning | None = None):  # fmt: skip
    """Pallas version of `paged_decode_attention_ref` (same arguments and result); see the notes above.
    tuning: None takes `decode_attention_tuning(q.dtype)`."""
    tuning = tuning or decode_attention_tuning(q.dtype)
    block_k, num_splits = tuning.block_k, tuning.num_splits
    (tokens, heads, dim), batch = q.shape, lengths.shape[0]  # the grid runs over the first `batch` rows
    kv_heads, page_size = k_pages.shape[3], k_pages.shape[2]
    group = heads // kv_heads
    rows = max(16, pl.next_power_of_2(group))
    held = group if group == pl.next_power_of_2(group) else rows  # query rows in memory: a power-of-two block
    qg = q.reshape(tokens, kv_heads, group, dim)
    if held != group:
        qg = pad_to(qg[:batch], (batch, kv_heads, held, dim))
    if num_splits is None:
        num_splits = decode_splits(batch, kv_heads, page_table.shape[1] * page_size, block_k)
    kernel = functools.partial(
        _decode_kernel, block_k=block_k, num_splits=num_splits, scale=dim**-0.5, rows=rows, early_launch=not interpret
    )
    whole = pl.BlockSpec(memory_space=pl.ANY)
    partial_shape = (num_splits, batch, kv_heads, held)
    compiler_params = plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=[whole, whole, whole, pl.BlockSpec((None, None, held, dim), lambda b, h, s: (b, h, 0, 0)),
                  whole, whole],
        out_specs=[pl.BlockSpec((None, None, None, held, dim), lambda b, h, s: (s, b, h, 0, 0)),
                   pl.BlockSpec((None, None, None, held), lambda b, h, s: (s, b, h, 0)),
                   pl.BlockSpec((None, None, None, held), lambda b, h, s: (s, b, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((*partial_shape, dim), jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32)],
        compiler_params=compiler_params,
        interpret=interpret,
        name="paged_decode_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), lengths, page_table, qg, k_pages, v_pages)  # fmt: skip
    if gate is not None and held == group:
        return _merge_gated(o, m, l, gate.reshape(tokens, kv_heads, group, dim), q.dtype, interpret)
    out = merge_splits(o, m, l)[:, :, :group]  # [B, KV, group, D]: a slice only where the rows were padded
    out = out.reshape(batch, heads, dim).astype(q.dtype)
    return out if gate is None else output_gate(out, gate[:batch].reshape(out.shape))


def _merge_kernel(o_ref, m_ref, l_ref, gate_ref, out_ref):
    """One (row, KV head): o_ref [S, group, D], m_ref / l_ref [S, group] -> out_ref [group, D] = the splits' merged,
    normalised output (`merge_splits`, rounded to the model dtype) times sigmoid(gate) (`output_gate`)."""
    splits = o_ref.shape[0]  # loaded one split at a time: Triton's tensors are powers of two, the splits need not be
    m_max = m_ref[0, :]
    for s in range(1, splits):
        m_max = jnp.maximum(m_max, m_ref[s, :])
    m_max = finite_max(m_max)  # [group]; rows no split saw keep 0
    acc = jnp.zeros(o_ref.shape[1:], jnp.float32)
    denominator = jnp.zeros(m_max.shape, jnp.float32)
    for s in range(splits):  # empty splits (m = -inf) weigh 0
        weight = jnp.exp(m_ref[s, :] - m_max)
        acc = acc + o_ref[s, :, :] * weight[:, None]
        denominator = denominator + l_ref[s, :] * weight
    out = normalise(acc, denominator).astype(out_ref.dtype)
    out_ref[...] = output_gate(out, gate_ref[...])


def _merge_gated(o, m, l, gate, dtype, interpret: bool):
    """o [S, B, KV, group, D], m and l [S, B, KV, group], gate [B' >= B, KV, group, D] -> [B, H, D]
    (`_merge_kernel`)."""
    splits, batch, kv_heads, group, dim = o.shape
    per_head = pl.BlockSpec((None, None, group, dim), lambda b, h: (b, h, 0, 0))
    partial = pl.BlockSpec((splits, None, None, group), lambda b, h: (0, b, h, 0))
    out = pl.pallas_call(
        _merge_kernel,
        grid=(batch, kv_heads),
        in_specs=[pl.BlockSpec((splits, None, None, group, dim), lambda b, h: (0, b, h, 0, 0)), partial, partial,
                  per_head],
        out_specs=per_head,
        out_shape=jax.ShapeDtypeStruct(o.shape[1:], dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="decode_attention_merge",
    )(o, m, l, gate)  # fmt: skip
    return out.reshape(batch, kv_heads * group, dim)
