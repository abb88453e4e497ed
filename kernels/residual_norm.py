"""The residual add and the next RMSNorm of a decode step, as one kernel.

Math, per row: out = round(sum_s partials[s]) (the product's output in the model dtype, as `linear` rounds it),
h' = round(h + out), y = round(h' * rsqrt(mean(h'^2) + eps) * (1 + w)) (the zero-centred `rms_norm`), all
arithmetic in fp32. Returns (h', y): the residual stream and the next products' input.
Layouts: h [M, N] (model dtype), partials [S, M, N] fp32 (the split-K partial sums of the product that made the
layer's output: o_proj, out_proj or down_proj; S = 1 for an unsplit product), w [N]; h' and y [M, N] in h's
dtype. partials None: h' = h (the first layer's input norm).

Why a kernel: XLA ran each of a decode step's 64 norm points as three small kernels (the split-K sum with the
residual add, the sum of squares, the scale: H200 batch-1 profile of session 7, 190 launches and 0.26 ms of a
3.03 ms step). XLA does not fuse a row reduction with the elementwise work that reads its result. Moving the
norm into the products instead slowed them more than it saved (session 7, docs/performance.md).

Measured slower, so not the `pallas` set's default (`pallas+add_norm=triton` selects it). H200, session 9, 4B
random weights, engine TPOT at batch 1 / 32: 3.21 / 4.82 ms with this kernel against 3.08 / 4.60 ms with XLA's
three kernels, in the same call (docs/performance.md). The profile puts it at 6.8 us a call (0.44 ms a batch-1
step for its 64 calls) against ~4.1 us for XLA's three: one program per row is one SM working alone, bound by
the latency of its load-sum-reduce-scale chain, where each of XLA's kernels spreads a row over many blocks.

Pallas kernel (Triton lowering): one program per row. It loads the row's partials as [S, block] tiles
(block: the largest power of two dividing N, at most 1024), all before any sum, keeps h' in registers (N fp32
values over the program's threads), sums the squares, then scales and stores. Rows above MAX_ROWS go to the reference: there
the products are XLA's GEMMs (`kernels.linear.MAX_ROWS`), whose output XLA can fuse into the add.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qwen35_jax.kernels.linear import MAX_ROWS

MAX_BLOCK = 1024
NUM_WARPS = 8  # a row is one program: more threads, fewer registers each for the tiles in flight


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back."""
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def add_partials(h: jax.Array, partials: jax.Array | None) -> jax.Array:
    """h + round(sum(partials, 0)): the product's output rounded to h's dtype, as `linear` rounds it, then added
    (h itself when partials is None)."""
    return h if partials is None else h + partials.sum(axis=0).astype(h.dtype)


def add_rms_norm_ref(h: jax.Array, partials: jax.Array | None, weight: jax.Array, eps: float):
    """(add_partials(h, partials), rms_norm of that): the model's add and norm as XLA computes them."""
    h = add_partials(h, partials)
    return h, rms_norm(h, weight, eps)


def _kernel(partials_ref, h_ref, w_ref, h_out_ref, normed_ref, *, block: int, eps: float):
    n, dtype = h_ref.shape[0], h_ref.dtype
    # Every piece's [splits, block] tile is loaded before any arithmetic, one load each, so that no load waits on
    # a sum. (The first form loaded a partial at a time between the adds, with 4 warps: +0.17 ms a batch-1 step
    # over XLA's kernels; this one +0.13 ms, on another machine: engine runs of session 9, calls 2 and 3.)
    tiles = [partials_ref[:, pl.ds(j * block, block)] for j in range(n // block)]
    pieces, squares = [], jnp.zeros((block,), jnp.float32)
    for j, tile in enumerate(tiles):
        cols = pl.ds(j * block, block)
        out = jnp.sum(tile, axis=0).astype(dtype)  # the product's output, as `linear` rounds it
        new = (h_ref[cols].astype(jnp.float32) + out.astype(jnp.float32)).astype(dtype)
        h_out_ref[cols] = new
        x32 = new.astype(jnp.float32)
        squares = squares + x32 * x32
        pieces.append(x32)
    scale = lax.rsqrt(jnp.sum(squares) / n + eps)
    for j, x32 in enumerate(pieces):  # rms_norm's order: (x * rsqrt) * (1 + w)
        cols = pl.ds(j * block, block)
        normed_ref[cols] = ((x32 * scale) * (1.0 + w_ref[cols].astype(jnp.float32))).astype(dtype)


def fits_kernel(h_shape, splits: int, block: int) -> bool:
    """At most MAX_ROWS rows, a row that `block`-wide pieces of >= 16 divide, and a power-of-two number of
    partials (the products' splits at 4B are 1 or 8): the [S, block] tile then needs no masked rows. With 6
    partials (tile rows 6 and 7 masked) the H200 build gave wrong sums (session 9 GPU test), which interpret
    mode did not show; not investigated further, since the kernel is not the default."""
    rows, n = h_shape
    return rows <= MAX_ROWS and block >= 16 and n % block == 0 and splits & (splits - 1) == 0


def add_rms_norm_pallas(h, partials, weight, eps: float, *, block=None, num_warps=None, interpret=False):
    """Pallas form of `add_rms_norm_ref` (same rounding; the partials and the squares summed in a different
    order). Rows above MAX_ROWS, partials None, and rows no power-of-two block divides take the reference."""
    n = h.shape[-1]
    block = block or min(MAX_BLOCK, n & -n)
    if partials is not None and partials.shape[1:] != h.shape:
        raise ValueError(f"partials {partials.shape} do not match h {h.shape} (expected [S, M, N])")
    if partials is None or h.ndim != 2 or not fits_kernel(h.shape, partials.shape[0], block):
        return add_rms_norm_ref(h, partials, weight, eps)
    rows, splits = h.shape[0], partials.shape[0]
    row_spec = pl.BlockSpec((None, n), lambda m: (m, 0))
    h_out, normed = pl.pallas_call(
        functools.partial(_kernel, block=block, eps=eps),
        grid=(rows,),
        in_specs=[pl.BlockSpec((splits, None, n), lambda m: (0, m, 0)), row_spec, pl.BlockSpec((n,), lambda m: (0,))],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(h.shape, h.dtype)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(partials, h, weight)
    return h_out, normed
