"""The MLP's activation and its down product in one kernel, for decode steps of a few rows:
parts = split-K partial sums of silu_mul(gate, up) @ W^T.

Math (`glu_linear_parts_ref`): gate, up = gate_up[:, :I], gate_up[:, I:]; x = silu_mul(gate, up) (`silu_mul`:
silu in fp32 rounded to the model dtype, times up, rounded once); the product as `linear_parts_ref`'s partial sums.
Layouts: gate_up [M, 2I] (the gate/up product as it comes out, gate then up), W [N, I]; returns [S, M, N], fp32
when K is split (one part in the model dtype when not), as `linear_parts_pallas`.

Why a kernel: at batch 1 the activation is an XLA kernel of ~2 us between the gate/up and down products in each of
a 4B step's 32 layers, and one more node of the step's CUDA graph. The down product is narrow (N = 2560), so
`linear`'s tiling splits its K: each program reads only its K range of gate and up, twice the bytes of x it would
read anyway.

Pallas kernel (Triton lowering): `linear`'s grid (N / block_n, splits). Each block_k step makes the operand from
gate's and up's slices, fetched a step ahead by hand (Triton pipelines only the loads that feed the dot as loaded;
docs/kernels.md), and adds its product with W's tile to the accumulator. Only `FUSED_MAX_ROWS` rows take it (the
model hands it no more); other shapes take XLA's activation and `linear_parts_pallas`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qwen35_jax.kernels.linear import (
    LinearTuning,
    _load_rows,
    _store_rows,
    _tile,
    default_splits,
    fits_kernel,
    linear_parts_pallas,
    linear_parts_ref,
)

FUSED_MAX_ROWS = 1  # as norm_linear's: the rows a decode step hands the fused form
TUNING = LinearTuning()  # the product's tiling: `linear`'s


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The MLP's activation: silu(gate) rounded to the model dtype, times up (the exact product of two bf16
    values fits fp32, so this rounds once, as a bf16 multiply does)."""
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return (act.astype(jnp.float32) * up.astype(jnp.float32)).astype(up.dtype)


def glu_linear_parts_ref(gate_up, weight):
    """`linear_parts_ref` of silu_mul over gate_up's two halves."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return linear_parts_ref(silu_mul(gate, up), weight)


def _kernel(gate_up_ref, w_ref, out_ref, *, block_k: int, steps: int, rows: int):
    first, inner = pl.program_id(1) * steps, gate_up_ref.shape[-1] // 2
    held = 1 if gate_up_ref.shape[0] == 1 else rows  # one row: a vector broadcast to the tile (norm_linear's)

    def fetch(j):
        col = pl.multiple_of((first + j) * block_k, block_k)
        return _load_rows(gate_up_ref, held, col, block_k), _load_rows(gate_up_ref, held, inner + col, block_k)

    def step(j, carry):
        acc, (gate, up) = carry
        ahead = fetch(jnp.minimum(j + 1, steps - 1))
        x = silu_mul(gate, up)
        if held != rows:
            x = jnp.broadcast_to(x, (rows, block_k))
        w = w_ref[:, pl.ds(pl.multiple_of(j * block_k, block_k), block_k)]
        return acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32), ahead

    init = (jnp.zeros((rows, out_ref.shape[-1]), jnp.float32), fetch(0))
    acc, _ = lax.fori_loop(0, steps, step, init)
    _store_rows(out_ref, rows, acc.astype(out_ref.dtype))


def fuses(gate_up_shape, weight_shape, tuning: LinearTuning = TUNING, max_rows: int = FUSED_MAX_ROWS) -> bool:
    """Whether `glu_linear_parts_pallas` takes the fused kernel at these shapes."""
    n, k = weight_shape
    block_n, block_k = _tile(n, tuning.block_n), _tile(k, tuning.block_k)
    return (
        gate_up_shape[0] <= max_rows
        and gate_up_shape[-1] == 2 * k
        and fits_kernel((gate_up_shape[0], k), weight_shape, block_n, block_k, tuning.max_rows)
    )


def glu_linear_parts_pallas(gate_up, weight, *, tuning: LinearTuning = TUNING, max_rows: int = FUSED_MAX_ROWS,
                            interpret: bool = False):  # fmt: skip
    """Pallas form of `glu_linear_parts_ref` (layouts as there; the fp32 sums in another order, silu's rounding
    Triton's). Shapes the fused kernel does not take run XLA's activation, then `linear_parts_pallas`."""
    n, k = weight.shape
    if gate_up.ndim != 2 or gate_up.shape[-1] != 2 * k:
        raise ValueError(f"gate_up {gate_up.shape} is not [rows, 2 x the weight's K={k}]")
    if not fuses(gate_up.shape, weight.shape, tuning, max_rows):
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return linear_parts_pallas(silu_mul(gate, up), weight, tuning=tuning, interpret=interpret)
    m = gate_up.shape[0]
    block_n, block_k = _tile(n, tuning.block_n), _tile(k, tuning.block_k)
    splits = tuning.splits or default_splits(n, k, block_n, block_k, tuning)
    steps = k // block_k // splits
    if steps * splits * block_k != k:
        raise ValueError(f"splits={splits} does not divide K={k} into block_k={block_k} steps")
    return pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, steps=steps, rows=pl.next_power_of_2(max(m, 16))),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec(gate_up.shape, lambda i, s: (0, 0)),
                  pl.BlockSpec((block_n, steps * block_k), lambda i, s: (i, s))],
        out_specs=pl.BlockSpec((None, m, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), gate_up.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="glu_linear",
    )(gate_up, weight)  # fmt: skip
