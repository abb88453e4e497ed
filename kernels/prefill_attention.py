"""Prefill attention over a paged prefix plus the current chunk: causal, ragged over rows, GQA.

Math: the query at chunk index i of row p has absolute position start[p] + i and attends to its row's
cached positions j < start[p] (the pages) and to chunk indices t <= i (this chunk's K/V, passed in: the
model commits new K/V to the pages once per step, after all layers ran).
Scores and softmax in fp32; probabilities rounded to the model dtype before the value product.

Layouts:
    q           [P, T, H, D] model dtype (after q_norm and RoPE)
    k_pages     [L, N, page_size, KV, D];  v_pages the same;  layer int32 scalar
    page_table  [P, W] int32;  start [P] int32 tokens already cached before this chunk
    k_chunk     [P, T, KV, D] model dtype;  v_chunk the same
    lengths     [P] valid tokens of the chunk (queries past it produce values nobody reads)
Returns o [P, T, H, D] in q's dtype.
"""

from __future__ import annotations

import jax.numpy as jnp

from qwen35_jax.kernels.decode_attention import attend, gather_pages


def paged_prefill_attention_ref(q, k_pages, v_pages, layer, page_table, start, k_chunk, v_chunk, lengths):
    prefix_k = gather_pages(k_pages, layer, page_table)
    prefix_v = gather_pages(v_pages, layer, page_table)
    chunk = q.shape[1]
    prefix_mask = jnp.arange(prefix_k.shape[1])[None, :] < start[:, None]  # [P, S]
    causal = jnp.arange(chunk)[None, :] <= jnp.arange(chunk)[:, None]  # [T, T]
    mask = jnp.concatenate(
        [jnp.broadcast_to(prefix_mask[:, None, :], (q.shape[0], chunk, prefix_k.shape[1])),
         jnp.broadcast_to(causal[None], (q.shape[0], chunk, chunk))], axis=-1,
    )  # fmt: skip
    k = jnp.concatenate([prefix_k, k_chunk], axis=1)
    v = jnp.concatenate([prefix_v, v_chunk], axis=1)
    return attend(q, k, v, mask, q.shape[-1] ** -0.5)
