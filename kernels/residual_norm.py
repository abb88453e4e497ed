"""The residual add and the RMSNorm that follows it, in one kernel: h <- h + delta, x = norm(h).

Math (per row; HF's order and rounding, as the model computed it in XLA):
    delta = round(sum_s parts[s])              the weight product's output: split-K partial sums (fp32), or one
                                               part already in the model dtype (then the sum is the value itself)
    h'    = round(h + delta)                   the residual stream, model dtype
    x     = round(h' * rsqrt(mean(h'^2) + eps) * (1 + w))   zero-centred RMSNorm in fp32 (`rms_norm`)
Layouts: h [M, K], parts [S, M, K], w [K]; returns h' and x [M, K] in h's dtype.

Why a kernel: a decode layer does this twice (after the token mixer and after the MLP, the second fused with the
next layer's input norm), and XLA made each three kernels (the partials' sum with the add, the sum of squares,
the scaling), as it cannot fuse a row reduction with both its producer and its consumer. At batch 1 on the H200
each of those ran ~1.2 us plus its launch gap, ~0.25 ms of a 3 ms 4B step over 64 norms.

Pallas kernel (Triton lowering): grid (M,), one program a row. It loads the row whole (K padded to a power of two
and masked: 4096 lanes for the 4B model's 2560), so the sum of squares is one register reduction, and the partials
are summed where they are read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back."""
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def residual_delta(parts: jax.Array, dtype) -> jax.Array:
    """A weight product's output from its partial sums [S, ..., N]: summed in fp32, rounded to dtype."""
    return parts.astype(jnp.float32).sum(axis=0).astype(dtype) if parts.shape[0] > 1 else parts[0].astype(dtype)


def residual_norm_ref(h, parts, weight, eps: float):
    """(h + delta, rms_norm(h + delta)) with delta = `residual_delta(parts)`; XLA's ops."""
    h = h + residual_delta(parts, h.dtype)
    return h, rms_norm(h, weight, eps)


def _row(ref, lanes: int, part: int | None = None):
    """ref's whole row (of a [S, K] ref: part `part`'s) as `lanes` values (a power of two >= its width), the lanes
    past it masked to 0. A part is loaded as a [1, lanes] slice and its axis summed away: one indexer of slices,
    which both the Triton lowering and interpret mode take."""
    if part is None:
        if ref.shape[-1] == lanes:
            return ref[...]
        return pltriton.load(ref.at[pl.ds(0, lanes)], mask=jnp.arange(lanes) < ref.shape[-1], other=0)
    if ref.shape[-1] == lanes:
        return ref[pl.ds(part, 1), :].sum(axis=0)
    mask = (jnp.arange(lanes) < ref.shape[-1])[None, :]
    return pltriton.load(ref.at[pl.ds(part, 1), pl.ds(0, lanes)], mask=mask, other=0).sum(axis=0)


def _store_row(ref, value, lanes: int) -> None:
    if ref.shape[-1] == lanes:
        ref[...] = value
    else:
        pltriton.store(ref.at[pl.ds(0, lanes)], value, mask=jnp.arange(lanes) < ref.shape[-1])


def _kernel(h_ref, parts_ref, w_ref, h_out_ref, x_out_ref, *, lanes: int, eps: float):
    width, dtype = h_ref.shape[-1], h_out_ref.dtype
    delta = _row(parts_ref, lanes, 0).astype(jnp.float32)
    for s in range(1, parts_ref.shape[0]):
        delta = delta + _row(parts_ref, lanes, s).astype(jnp.float32)
    h = (_row(h_ref, lanes).astype(jnp.float32) + delta.astype(dtype).astype(jnp.float32)).astype(dtype)
    _store_row(h_out_ref, h, lanes)
    h32 = h.astype(jnp.float32)  # the masked lanes are 0, so they add nothing to the sum of squares
    scale = lax.rsqrt(jnp.sum(h32 * h32) / width + eps)
    x = h32 * scale * (1.0 + _row(w_ref, lanes).astype(jnp.float32))
    _store_row(x_out_ref, x.astype(dtype), lanes)


def residual_norm_pallas(h, parts, weight, eps: float, *, interpret: bool = False):
    """Pallas form of `residual_norm_ref` (same layouts and rounding; the partials summed in order)."""
    rows, width = h.shape
    if parts.shape[1:] != h.shape or weight.shape != (width,):
        raise ValueError(f"parts {parts.shape} and weight {weight.shape} do not match h {h.shape}")
    row_spec = pl.BlockSpec((None, width), lambda m: (m, 0))
    return pl.pallas_call(
        functools.partial(_kernel, lanes=pl.next_power_of_2(width), eps=eps),
        grid=(rows,),
        in_specs=[row_spec, pl.BlockSpec((parts.shape[0], None, width), lambda m: (0, m, 0)),
                  pl.BlockSpec((width,), lambda m: (0,))],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(h.shape, h.dtype)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="residual_norm",
    )(h, parts, weight)  # fmt: skip
