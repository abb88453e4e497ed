"""Causal depthwise conv1d (kernel K, no bias) + SiLU over the GDN qkv channels, continuing from a conv state.

Math: y[t, c] = silu( sum_{j<K} w[c, j] * x[t - K + 1 + j, c] ), where x before the row's first token comes
from the conv state (the last K-1 inputs seen), or zeros for a fresh sequence. Cross-correlation: no flip.
Rounding follows HF: the conv result is rounded to the model dtype before the SiLU.

Layouts:
    x          [P, T, C] (prefill) or [B, C] (one-token update), model dtype
    weight     [C, K] model dtype
    conv_state [rows, K-1, C] model dtype, oldest input first (zeros for a fresh sequence)
    lengths    [P] valid tokens per row
Returns y (same shape as x, model dtype) and each row's new conv state: its last K-1 valid inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _conv_silu(window: jax.Array, weight: jax.Array, out_len: int) -> jax.Array:
    """window [rows, K-1+T, C] -> silu(conv) [rows, T, C]."""
    taps = weight.shape[1]
    acc = sum(window[:, j : j + out_len].astype(jnp.float32) * weight[:, j].astype(jnp.float32) for j in range(taps))
    acc = acc.astype(window.dtype).astype(jnp.float32)
    return jax.nn.silu(acc).astype(window.dtype)


def causal_conv1d_prefill_ref(x, weight, conv_state, lengths):
    seq, keep = x.shape[1], conv_state.shape[1]
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
    y = _conv_silu(window, weight, seq)
    new_state = jax.vmap(lambda w, n: lax.dynamic_slice_in_dim(w, n, keep, axis=0))(window, lengths)
    return y, new_state.astype(conv_state.dtype)


def causal_conv1d_update_ref(x, weight, conv_state):
    window = jnp.concatenate([conv_state.astype(x.dtype), x[:, None, :]], axis=1)
    y = _conv_silu(window, weight, 1)[:, 0]
    return y, window[:, 1:].astype(conv_state.dtype)
