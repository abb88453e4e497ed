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
"""

from __future__ import annotations

import jax.numpy as jnp

from qwen35_jax.kernels.decode_attention import attend, gather_pages


def paged_prefill_attention_ref(q, k_pages, v_pages, layer, page_table, start, lengths):
    k = gather_pages(k_pages, layer, page_table)
    v = gather_pages(v_pages, layer, page_table)
    query_pos = start[:, None] + jnp.arange(q.shape[1])[None, :]  # [P, T]
    mask = jnp.arange(k.shape[1])[None, None, :] <= query_pos[:, :, None]
    return attend(q, k, v, mask, q.shape[-1] ** -0.5)
