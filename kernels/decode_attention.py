"""Paged decode attention: one query token per row against that row's pages, GQA.

Math: o[b, h] = softmax_j( q[b, h] . k[b, j, h // group] * scale ) v[b, j, h // group] over j < lengths[b],
scores and softmax in fp32, probabilities rounded to the model dtype before the value product (as HF eager).

Layouts:
    q           [B, H, D]   model dtype (after q_norm and RoPE)
    k_pages     [L, N, page_size, KV, D] model dtype (the current token's K/V already written);  same for v
    layer       int32 scalar: which full-attention layer of the pool
    page_table  [B, W] int32: page ids of each row in order (unused entries point at the trash page 0)
    lengths     [B] int32: tokens in the cache for each row, the current one included
Returns o [B, H, D] in q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def paged_decode_attention_ref(q, k_pages, v_pages, layer, page_table, lengths):
    k = gather_pages(k_pages, layer, page_table)
    v = gather_pages(v_pages, layer, page_table)
    mask = (jnp.arange(k.shape[1])[None, :] < lengths[:, None])[:, None, :]
    return attend(q[:, None], k, v, mask, q.shape[-1] ** -0.5)[:, 0]
