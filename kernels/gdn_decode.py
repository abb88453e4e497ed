"""Gated DeltaNet one-token recurrent decode for a batch of slots, updating the state pool in place.

Math (per row b and value head h; key head h // ratio; S in R^{dk x dv}, fp32):
    q, k <- l2norm(q), l2norm(k) (eps 1e-6);  q <- q * dk^-0.5
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q

Layouts:
    q, k        [B, nk, dk]   model dtype (after conv + SiLU)
    v           [B, nv, dv]   model dtype
    g           [B, nv]       fp32;  beta [B, nv] model dtype
    state       [B, nv, dk, dv] fp32: each row's recurrent state for this layer
Returns o [B, nv, dv] in v's dtype and the new state (a kernel may update `state` in place: the model
gathers the step's rows from the slot pool once per step and scatters them back once).
"""

from __future__ import annotations

import jax.numpy as jnp

from qwen35_jax.kernels.gdn_prefill import prepare_qk


def gdn_decode_ref(q, k, v, g, beta, state):
    q, k = prepare_qk(q, k, v.shape[-2])
    state = state * jnp.exp(g.astype(jnp.float32))[..., None, None]
    v32 = v.astype(jnp.float32)
    u = beta.astype(jnp.float32)[..., None] * (v32 - jnp.einsum("bhde,bhd->bhe", state, k))
    state = state + k[..., :, None] * u[..., None, :]
    out = jnp.einsum("bhde,bhd->bhe", state, q)
    return out.astype(v.dtype), state
