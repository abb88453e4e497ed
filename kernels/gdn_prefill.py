"""Gated DeltaNet chunked prefill, ragged over request rows, continuing from per-slot fp32 state.

Math (per row p and value head h; key head h // ratio; state S in R^{dk x dv}, fp32):
    q, k <- l2norm(q), l2norm(k)  (eps 1e-6, fp32);  q <- q * dk^-0.5
    S_t = exp(g_t) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t);  S_t += k_t u_t^T;  o_t = S_t^T q_t
Chunked form (chunk C = 64, gamma = cumulative sum of g inside the chunk, Gamma_ij = exp(gamma_i - gamma_j), i >= j):
    A = strict_lower((beta K) K^T * Gamma);  U = (I + A)^-1 (beta V);  W = (I + A)^-1 (beta exp(gamma) K)
    per chunk, sequentially: V' = U - W S;  O = (Q exp(gamma)) S + tril((Q K^T) * Gamma) V'
                             S <- exp(gamma_last) S + (K exp(gamma_last - gamma))^T V'

Layouts:
    q, k        [P, T, nk, dk]   model dtype (after conv + SiLU, before l2norm)
    v           [P, T, nv, dv]   model dtype
    g           [P, T, nv]       fp32 (log decay, <= 0)
    beta        [P, T, nv]       model dtype
    state       [P, nv, dk, dv] fp32: each row's recurrent state before the chunk (zeros for a new sequence)
    lengths     [P] int32: valid tokens of each row (the tail is padding)
Returns o [P, T, nv, dv] in q's dtype and each row's state after its last valid token. Padding tokens (index >= length) leave the
state untouched: their beta, g and k are zeroed, which makes each of their updates the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

CHUNK = 64


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q: jax.Array, k: jax.Array, num_value_heads: int) -> tuple[jax.Array, jax.Array]:
    """fp32 l2norm, the dk^-0.5 query scale, and key-head -> value-head repeat (value head j reads j // ratio)."""
    ratio = num_value_heads // q.shape[-2]
    q = l2norm(q.astype(jnp.float32)) * (q.shape[-1] ** -0.5)
    k = l2norm(k.astype(jnp.float32))
    return jnp.repeat(q, ratio, axis=-2), jnp.repeat(k, ratio, axis=-2)


def _chunk_scan(q, k, v, g, beta, state):
    """q, k [P, H, n, C, dk]; v [P, H, n, C, dv]; g, beta [P, H, n, C]; state [P, H, dk, dv] (all fp32)."""
    size = q.shape[-2]
    lower = jnp.tril(jnp.ones((size, size), dtype=bool))
    gamma = jnp.cumsum(g, axis=-1)
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, gamma[..., :, None] - gamma[..., None, :], 0.0)), 0.0)
    k_beta = k * beta[..., None]
    system = jnp.einsum("phncd,phnkd->phnck", k_beta, k) * decay
    system = jnp.where(jnp.eye(size, dtype=bool), 1.0, jnp.where(lower, system, 0.0))
    new_values = jax.scipy.linalg.solve_triangular(system, v * beta[..., None], lower=True, unit_diagonal=True)
    k_cumdecay = jax.scipy.linalg.solve_triangular(
        system, k_beta * jnp.exp(gamma)[..., None], lower=True, unit_diagonal=True
    )
    intra = jnp.einsum("phncd,phnkd->phnck", q, k) * decay
    q_decayed = q * jnp.exp(gamma)[..., None]
    k_decayed = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]
    chunk_decay = jnp.exp(gamma[..., -1])[..., None, None]

    def step(state, xs):
        u, w, qd, kd, att, cd = xs
        v_new = u - jnp.einsum("phcd,phde->phce", w, state)
        out = jnp.einsum("phcd,phde->phce", qd, state) + jnp.einsum("phck,phke->phce", att, v_new)
        state = state * cd + jnp.einsum("phcd,phce->phde", kd, v_new)
        return state, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
    state, out = lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 2), state


def gdn_chunked_prefill_ref(q, k, v, g, beta, state, lengths):
    num_rows, seq, num_heads, dv = v.shape
    q, k = prepare_qk(q, k, num_heads)
    valid = (jnp.arange(seq)[None, :] < lengths[:, None])[..., None]  # [P, T, 1]
    k = jnp.where(valid[..., None], k, 0.0)
    g = jnp.where(valid, g.astype(jnp.float32), 0.0)
    beta = jnp.where(valid, beta.astype(jnp.float32), 0.0)
    pad = (-seq) % CHUNK
    n = (seq + pad) // CHUNK

    def chunked(x):  # [P, T, H, ...] -> [P, H, n, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(x.shape[:2] + (n, CHUNK) + x.shape[3:])

    out, state = _chunk_scan(chunked(q), chunked(k), chunked(v.astype(jnp.float32)), chunked(g), chunked(beta), state)
    out = jnp.moveaxis(out.reshape(num_rows, num_heads, n * CHUNK, dv), 1, 2)[:, :seq]
    return out.astype(v.dtype), state
