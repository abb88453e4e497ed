"""The residual add, the RMSNorm after it and the weight product that reads the norm, in one kernel, for decode
steps of a few rows: h <- h + delta, y = norm(h) @ W^T.

Math (per row; `norm_linear_ref`, which is `residual_norm_ref` then `linear_ref`):
    delta = round(sum_s parts[s])               the previous product's split-K partial sums (fp32), or one part
    h'    = round(h + delta)                    the residual stream, model dtype
    y     = round(round(h' * s * (1 + w)) @ W^T)   s = rsqrt(mean(h'^2) + eps), fp32 accumulation
The kernel computes y = round(s * (round(h' * (1 + w)) @ W^T)): s is one number a row, so it can scale the product's
fp32 sum after the fact, and each program learns it from the same loop that streams W. Only the rounding of the
product's bf16 operand moves (it is rounded before the scaling instead of after): the same relative error, 2^-8,
in another place (tests/test_kernels_norm_linear.py states the tolerance).
Layouts: h [M, K], parts [S, M, K], w (the norm's) [K], W [N, K]; returns h' [M, K] and y [M, N] in h's dtype.

Why a kernel: at batch 1 a decode layer's two `residual_norm` kernels are latency bound (one program a row, ~4 us
each on the H200, 64 a 4B step) and each is one more node of the step's CUDA graph, whose launch is most of the
host's time a step (docs/performance.md). The products that follow a norm (the GDN in_proj, the attention qkv, the
MLP gate/up) are wide, so `linear`'s tiling gives each of their programs the whole of K: each program can add the
residual and sum its squares over the K it walks anyway.

Pallas kernel (Triton lowering): `linear`'s grid (N / block_n,) with one K split. Program i walks K in block_k
steps; each step makes h' and the operand round(h' * (1 + w)) from h's, the parts' and w's slices (from L2: every
program reads them; fetched a step ahead, as Triton does not pipeline them), adds h'^2 to the row's sum of
squares and the operand's product with W's tile to the accumulator. Program 0 stores h'. At the end the
accumulator is scaled by s. Every program reads the parts and h, 4 S + 2 bytes a row and column of K where the
operand alone would be 2, so the kernel pays off only for a few rows (`NormLinearTuning.max_rows`); beyond them,
or when `linear` would split K, it is `residual_norm` then `linear`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qwen35_jax.kernels.device import start_dependents
from qwen35_jax.kernels.linear import (
    LinearTuning,
    _load_rows,
    _store_rows,
    _tile,
    default_splits,
    fits_kernel,
    linear_pallas,
    linear_ref,
)
from qwen35_jax.kernels.residual_norm import residual_norm_pallas, residual_norm_ref

# The most rows the model hands to `norm_linear` (more take `residual_norm` and the products apart, as the kernel's
# fallback would). At one row the parts and h a program reads from L2 are ~0.3 of the weight bytes it streams from
# HBM (4 fp32 parts and h: 18 bytes a column against 32 columns of bf16 weights, 64 bytes); at four rows, 1.1.
FUSED_MAX_ROWS = 1


@dataclasses.dataclass(frozen=True)
class NormLinearTuning:
    """max_rows: the most rows that take the fused kernel (every program reads the rows' parts from L2, so the
    L2 traffic grows with the rows while the weight bytes do not); linear: the product's tiling."""

    max_rows: int = FUSED_MAX_ROWS
    linear: LinearTuning = LinearTuning()


def norm_linear_ref(h, parts, norm_weight, weight, eps: float):
    """(h', y): `residual_norm_ref`, then `linear_ref` of its norm."""
    h, x = residual_norm_ref(h, parts, norm_weight, eps)
    return h, linear_ref(x, weight)


def _parts_rows(ref, s: int, rows: int, col, width: int):
    """Part s's [rows, width] slice at column col, fp32; rows past M masked to 0."""
    if ref.shape[1] == rows:
        return ref[pl.ds(s, 1), :, pl.ds(col, width)].sum(axis=0).astype(jnp.float32)
    valid = (jnp.arange(rows)[:, None] < ref.shape[1])[None]
    block = pltriton.load(ref.at[pl.ds(s, 1), pl.ds(0, rows), pl.ds(col, width)], mask=valid, other=0)
    return block.sum(axis=0).astype(jnp.float32)


def _kernel(h_ref, parts_ref, norm_ref, w_ref, h_out_ref, y_ref, *, block_k: int, rows: int, eps: float,
            early_launch: bool):  # fmt: skip
    width, dtype, steps = h_ref.shape[-1], h_ref.dtype, h_ref.shape[-1] // block_k
    # One row is handled as a [1, block_k] vector and broadcast to the product's tile rows (the rows past it are
    # never stored), so the carried loads cost a few registers, not 16 rows of them.
    held = 1 if h_ref.shape[0] == 1 else rows
    writes_h = start_dependents(pl.program_id(0), early_launch) == 0

    def fetch(j):
        """Step j's h, parts and norm weight slices. Triton pipelines only the loads that feed the dot as loaded
        (W's), so these are fetched one step ahead by hand: step j computes on what step j - 1 fetched, and the
        loads' L2 latency hides behind step j's product (docs/kernels.md, "tried")."""
        col = j * block_k if isinstance(j, int) else pl.multiple_of(j * block_k, block_k)
        parts = tuple(_parts_rows(parts_ref, s, held, col, block_k) for s in range(parts_ref.shape[0]))
        return _load_rows(h_ref, held, col, block_k), parts, norm_ref[pl.ds(col, block_k)]

    def step(j, carry):
        acc, squares, (h, parts, norm) = carry
        col = pl.multiple_of(j * block_k, block_k)
        ahead = fetch(jnp.minimum(j + 1, steps - 1))
        delta = parts[0]
        for part in parts[1:]:
            delta = delta + part
        h_new = (h.astype(jnp.float32) + delta.astype(dtype).astype(jnp.float32)).astype(dtype)

        @pl.when(writes_h)
        def _():
            _store_rows(h_out_ref, held, h_new, col)

        h32 = h_new.astype(jnp.float32)  # masked rows and lanes are 0: they add nothing to the squares
        x = (h32 * (1.0 + norm.astype(jnp.float32))[None, :]).astype(dtype)
        if held != rows:
            x = jnp.broadcast_to(x, (rows, block_k))
        w = w_ref[:, pl.ds(col, block_k)]
        acc = acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc, squares + jnp.sum(h32 * h32, axis=1, keepdims=True), ahead

    init = (jnp.zeros((rows, y_ref.shape[-1]), jnp.float32), jnp.zeros((held, 1), jnp.float32), fetch(0))
    acc, squares, _ = lax.fori_loop(0, steps, step, init)
    _store_rows(y_ref, rows, (acc * lax.rsqrt(squares / width + eps)).astype(dtype))


def fuses(h_shape, weight_shape, tuning: NormLinearTuning = NormLinearTuning()) -> bool:
    """Whether `norm_linear_pallas` takes the fused kernel at these shapes: few enough rows, tiles that divide
    the weight, and one K split (each program must see the whole row)."""
    n, k = weight_shape
    lin = tuning.linear
    block_n, block_k = _tile(n, lin.block_n), _tile(k, lin.block_k)
    return (
        h_shape[0] <= min(tuning.max_rows, lin.max_rows)
        and fits_kernel(h_shape, weight_shape, block_n, block_k, lin.max_rows)
        and (lin.splits or default_splits(n, k, block_n, block_k, lin)) == 1
    )


def norm_linear_pallas(h, parts, norm_weight, weight, eps: float, *, tuning: NormLinearTuning = NormLinearTuning(),
                       interpret: bool = False):  # fmt: skip
    """Pallas form of `norm_linear_ref` (layouts as there; the rounding as the module docstring says). Shapes the
    fused kernel does not take run `residual_norm_pallas`, then `linear_pallas`."""
    rows, width = h.shape
    if parts.shape[1:] != h.shape or norm_weight.shape != (width,) or weight.shape[1] != width:
        raise ValueError(f"parts {parts.shape}, norm weight {norm_weight.shape} and weight {weight.shape} do not "
                         f"match h {h.shape}")  # fmt: skip
    if not fuses(h.shape, weight.shape, tuning):
        h, x = residual_norm_pallas(h, parts, norm_weight, eps, interpret=interpret)
        return h, linear_pallas(x, weight, tuning=tuning.linear, interpret=interpret)
    n = weight.shape[0]
    block_n, block_k = _tile(n, tuning.linear.block_n), _tile(width, tuning.linear.block_k)
    whole = lambda i: (0, 0)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, rows=pl.next_power_of_2(max(rows, 16)), eps=eps,
                          early_launch=not interpret),
        grid=(n // block_n,),
        in_specs=[pl.BlockSpec(h.shape, whole), pl.BlockSpec(parts.shape, lambda i: (0, 0, 0)),
                  pl.BlockSpec((width,), lambda i: (0,)), pl.BlockSpec((block_n, width), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec(h.shape, whole), pl.BlockSpec((rows, block_n), lambda i: (0, i))],
        out_shape=[jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct((rows, n), h.dtype)],
        compiler_params=pltriton.CompilerParams(num_warps=tuning.linear.num_warps,
                                                num_stages=tuning.linear.num_stages),
        interpret=interpret,
        name="norm_linear",
    )(h, parts, norm_weight, weight)  # fmt: skip
