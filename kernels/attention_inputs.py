"""The full-attention layer's inputs from its qkv product: q and k normalised and rotated, and the step's K/V written
into the layer's pages.

Math (per token n; HF's Qwen3.5 order and rounding):
    query_h, gate_h = q_gate[n, h, :D], q_gate[n, h, D:]      q_proj's rows are [query_h | gate_h] per head h
    q[n, h] = rope(rms_norm(query_h, q_norm))                 zero-centred RMSNorm in fp32, cast to the model dtype
    k[n, j] = rope(rms_norm(k_j, k_norm))
    rope(x)[:r] = round(round(x[:r] cos) + round(rotate_half(x[:r]) sin)),  rope(x)[r:] = x[r:]   (r = rotary dim)
    k_pages[layer, kv_page[n], kv_offset[n]] = k[n];  v_pages[...] = v[n] (as projected)
Layouts: qkv [N, 2 H D + 2 KV D], the fused product with its parts q_gate [N, 2 H D], k [N, KV D] and v [N, KV D]
side by side; q_norm, k_norm [D]; cos, sin [N, r]; pages [L, P, page_size, KV, D]; kv_page, kv_offset [N] int32
(padding tokens point at the trash page). Returns q [N, H, D], k [N, KV, D], the output gate [N, H, D] (q_gate's
second halves, dense) and the two page pools with the tokens written (in place under jit with the pools donated).

Why a kernel: XLA made these five kernels a layer in a decode step (the two norms with the rotation of q, of k with
the K write, the V write, and a copy), ~1.3 us each at batch 1 on the H100 against one of about the same time;
a 4B step has 8 such layers. The gate is copied out dense (8 KiB a token at 4B) so that the decode attention's split
merge can read it as a block and apply it (`decode_attention.py`); v stays where the product wrote it, for the
prefill attention.

Pallas kernel (Triton lowering): grid (N,), one program a token. The parts are read in place through BlockSpecs on
views of the product as rows of D (q_gate: rows of 2 D, the query the first half of each): slices of it handed to a
kernel would be copies. rotate_half needs each lane's partner (i +- r/2), which a register tile cannot permute, so
the partner lanes are loaded again from memory with permuted column indices (an L1 hit) and normalised with the
row's own scale. K and V go to the pool refs (pl.ANY, aliased in to out) with scalar indices, as the decode kernels
index their pools: int64 offsets once a pool passes 2^32 bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qwen35_jax.kernels.residual_norm import rms_norm


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    """Partial RoPE on the first rotary_dim dims, rotate_half pairs (i, i + rotary_dim/2); x [N, heads, D]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot = (x_rot * cos).astype(x.dtype) + (rotate_half(x_rot) * sin).astype(x.dtype)
    return jnp.concatenate([x_rot.astype(x.dtype), x_pass], axis=-1)


def split_qkv(qkv, heads: int, kv_heads: int):
    """(q_gate [N, H, 2D], k [N, KV, D], v [N, KV, D]) of the fused product."""
    n, dim = qkv.shape[0], qkv.shape[-1] // (2 * heads + 2 * kv_heads)
    q_gate, k, v = jnp.split(qkv, (2 * heads * dim, (2 * heads + kv_heads) * dim), axis=-1)
    return q_gate.reshape(n, heads, 2 * dim), k.reshape(n, kv_heads, dim), v.reshape(n, kv_heads, dim)


def attention_inputs_ref(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, layer, kv_page, kv_offset, *,
                         heads: int, kv_heads: int, eps: float):  # fmt: skip
    """XLA's ops: (q [N, H, D], k [N, KV, D], gate [N, H, D], k_pages, v_pages); the module notes."""
    q_gate, k, v = split_qkv(qkv, heads, kv_heads)
    dim = k.shape[-1]
    q = apply_rope(rms_norm(q_gate[..., :dim], q_norm, eps), cos, sin)
    k = apply_rope(rms_norm(k, k_norm, eps), cos, sin)
    k_pages = k_pages.at[layer, kv_page, kv_offset].set(k)
    v_pages = v_pages.at[layer, kv_page, kv_offset].set(v)
    return q, k, q_gate[..., dim:], k_pages, v_pages


def _rope_lanes(dim: int, rot: int):
    """Per lane of a head: its rotate_half partner (itself past the rotary dims) and the partner's sign."""
    lane = lax.iota(jnp.int32, dim)
    half = rot // 2
    partner = jnp.where(lane < half, lane + half, jnp.where(lane < rot, lane - half, lane))
    return lane, partner, jnp.where(lane < half, -1.0, 1.0)


def _masked_table(ref, dim: int):
    """A [r] cos or sin row as `dim` lanes (lanes past r: 0; they take the unrotated value)."""
    return pltriton.load(ref.at[pl.ds(0, dim)], mask=lax.iota(jnp.int32, dim) < ref.shape[0], other=0)


def _norm_rope(x_ref, w_ref, cos, sin, rot: int, eps: float):
    """rope(rms_norm(x)) of a [heads, D] block, in the model dtype (the module notes' rounding)."""
    dim, dtype = x_ref.shape[-1], x_ref.dtype
    lane, partner, sign = _rope_lanes(dim, rot)
    x = x_ref[...].astype(jnp.float32)
    scale = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = (x * scale * (1.0 + w_ref[...].astype(jnp.float32))).astype(dtype)
    # The partner lanes, normalised with the row's own scale: the same value as `normed` at the partner's lane.
    heads = lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
    x_partner = x_ref[heads, jnp.broadcast_to(partner[None, :], x_ref.shape)].astype(jnp.float32)
    normed_partner = (x_partner * scale * (1.0 + w_ref[partner].astype(jnp.float32))).astype(dtype)
    a = (normed.astype(jnp.float32) * cos[None, :]).astype(dtype)
    b = (sign[None, :] * normed_partner.astype(jnp.float32) * sin[None, :]).astype(dtype)
    roped = (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(dtype)
    return jnp.where((lane < rot)[None, :], roped, normed)


def _kernel(layer_ref, page_ref, offset_ref, query_ref, gate_in_ref, key_ref, value_ref, q_norm_ref, k_norm_ref,
            cos_ref, sin_ref, k_pages_ref, v_pages_ref, q_ref, k_ref, gate_ref, k_pages_out, v_pages_out, *,
            eps: float):  # fmt: skip
    dim, rot = query_ref.shape[-1], cos_ref.shape[0]
    cos = _masked_table(cos_ref, dim).astype(jnp.float32)
    sin = _masked_table(sin_ref, dim).astype(jnp.float32)
    q_ref[...] = _norm_rope(query_ref, q_norm_ref, cos, sin, rot, eps)
    k = _norm_rope(key_ref, k_norm_ref, cos, sin, rot, eps)
    k_ref[...] = k
    gate_ref[...] = gate_in_ref[...]
    slot = (layer_ref[0], page_ref[...], offset_ref[...], slice(None), slice(None))
    k_pages_out[slot] = k
    v_pages_out[slot] = value_ref[...]


def _sources(qkv, heads: int, kv_heads: int):
    """(query rows [N, rows, 2D], the product as rows [N, rows, D], and the key's and value's block indices there),
    bitcast views of the product, read in place."""
    n, dim = qkv.shape[0], qkv.shape[-1] // (2 * heads + 2 * kv_heads)
    # k starts at row 2H of D, v at 2H + KV: blocks of KV rows, so block indices 2H / KV and 2H / KV + 1.
    return qkv.reshape(n, -1, 2 * dim), qkv.reshape(n, -1, dim), 2 * heads // kv_heads, 2 * heads // kv_heads + 1


def attention_inputs_pallas(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, layer, kv_page, kv_offset, *,
                            heads: int, kv_heads: int, eps: float, interpret: bool = False):  # fmt: skip
    """Pallas form of `attention_inputs_ref` (same arguments and results; the module notes). Head counts and the
    head dim must be powers of two (Triton blocks) and the rotary dim even; other shapes take the reference."""
    dim = q_norm.shape[0]
    rot = cos.shape[-1]
    if any(d & (d - 1) for d in (heads, kv_heads, dim)) or rot % 2 or rot > dim or (2 * heads) % kv_heads:
        return attention_inputs_ref(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, layer, kv_page, kv_offset,
                                    heads=heads, kv_heads=kv_heads, eps=eps)  # fmt: skip
    query_rows, rows, key_block, value_block = _sources(qkv, heads, kv_heads)
    n = query_rows.shape[0]
    whole = pl.BlockSpec(memory_space=pl.ANY)
    token = pl.BlockSpec((None,), lambda i: (i,))
    vector = pl.BlockSpec((dim,), lambda i: (0,))
    table = pl.BlockSpec((None, rot), lambda i: (i, 0))
    per_head = pl.BlockSpec((None, heads, dim), lambda i: (i, 0, 0))
    q, k, gate, k_pages, v_pages = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(n,),
        in_specs=[whole, token, token,
                  per_head,  # the query half of each head's 2 D
                  pl.BlockSpec((None, heads, dim), lambda i: (i, 0, 1)),  # the gate half
                  pl.BlockSpec((None, kv_heads, dim), lambda i: (i, key_block, 0)),
                  pl.BlockSpec((None, kv_heads, dim), lambda i: (i, value_block, 0)),
                  vector, vector, table, table, whole, whole],
        out_specs=[per_head, pl.BlockSpec((None, kv_heads, dim), lambda i: (i, 0, 0)), per_head, whole, whole],
        out_shape=[jax.ShapeDtypeStruct((n, heads, dim), query_rows.dtype),
                   jax.ShapeDtypeStruct((n, kv_heads, dim), query_rows.dtype),
                   jax.ShapeDtypeStruct((n, heads, dim), query_rows.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={11: 3, 12: 4},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="attention_inputs",
    )(jnp.asarray(layer, jnp.int32).reshape(1), kv_page.astype(jnp.int32), kv_offset.astype(jnp.int32), query_rows,
      query_rows, rows, rows, q_norm, k_norm, cos, sin, k_pages, v_pages)  # fmt: skip
    return q, k, gate, k_pages, v_pages
