"""The decode step's weight products: y = x @ W^T for a few token rows, read at HBM bandwidth.

Math: y[m, n] = sum_k x[m, k] * w[n, k], fp32 accumulation, rounded to x's dtype (`linear_ref`).
Layouts: x [M, K] (model dtype), w [N, K] (HF's [out, in]), y [M, N] (x's dtype).

Why a kernel: a decode step at small batch is a chain of weight GEMVs, and their time is the weight bytes over
HBM bandwidth. XLA's Triton GEMM emitter leaves them at 34-70% of the H200's bandwidth, by shape and batch, with no
form or backend winning everywhere; with the emitter off, cuBLAS is slower still (docs/kernels.md).

Pallas kernel (Triton lowering): grid (N / block_n, splits). Program (i, s) owns output columns
i*block_n .. +block_n and the s-th of `splits` equal K ranges; it walks its range in block_k steps, each a
[rows, block_k] x [block_k, block_n] tensor-core product (rows = M padded to a power of two >= 16, the smallest
tensor-core tile; x is tiny and read from L2 by every program), accumulating in fp32. The tiles are powers of two
that divide N and K. Splitting K gives a narrow weight (N = 2560 at 4B) enough programs to keep every SM's loads in
flight; the splits' fp32 partial sums [splits, M, N] are added by XLA, which fuses the sum into the consumer.
Rows: x keeps its M rows (no padding copy); the tiles' rows past M are masked on load and store (contiguous
columns, so the loads stay vectorised).
Only M <= tuning.max_rows goes to the kernel: from 64 rows on, XLA's GEMMs, which tile M, are faster. Shapes with N
or K not a multiple of 16 go to `linear_ref` too.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qwen35_jax.kernels.device import sm_count, start_dependents


@dataclasses.dataclass(frozen=True)
class LinearTuning:
    """How the kernel is built. The defaults are the best tiling of every 4B product at batch 1 and 64 in the H200
    sweep (`tools/bench_linear.py`: 64-79% of HBM bandwidth at batch 1)."""

    max_rows: int = 32  # decode batches up to this go to the kernel; at 64 rows XLA's GEMMs were 3-13% faster
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    # Programs an SM that the K splits aim for. Two: a wide weight (4B in_proj, 386 column blocks; attention qkv, 320)
    # then reads its whole K in one program, 8-9% faster at batch 1 than the two splits that four an SM asked for,
    # and the narrow weights' splits are as fast (`tools/bench_linear.py --splits`, docs/kernels.md).
    programs_per_sm: int = 2
    min_steps: int = 4  # block_k steps a program at least (a longer loop pipelines its loads better)
    splits: int | None = None  # K splits; None: `default_splits`

    def __post_init__(self):
        for name in ("block_n", "block_k"):  # a tile that cannot divide would send every shape to XLA's product
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearTuning.{name} must be a power of two >= 16, got {value}")


def linear_ref(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w[N, K]^T with fp32 accumulation, x's dtype out (XLA's dot). The product is asked for in x's
    dtype, not as fp32 and then cast: the GPU's GEMMs (cuBLAS, Triton) accumulate in fp32 either way and round once
    on store, while an fp32 result cast apart costs a kernel that reads and writes the whole output (a prefill
    chunk's MLP gate/up: 27 of its 190 us on the H200). On the CPU both forms give the same bits."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=x.dtype)


def default_splits(n: int, k: int, block_n: int, block_k: int, tuning: LinearTuning = LinearTuning()) -> int:
    """The fewest K splits that give every SM `programs_per_sm` programs, keeping >= `min_steps` block_k steps each
    and dividing K's steps evenly."""
    steps, target = k // block_k, tuning.programs_per_sm * sm_count()
    best = 1
    for splits in range(1, steps + 1):
        if steps % splits or steps // splits < tuning.min_steps:
            continue
        best = splits
        if (n // block_n) * splits >= target:
            break
    return best


def _load_rows(ref, rows: int, col, width: int):
    """ref's [rows, width] block at column `col`: the first rows of the tile are x's M rows, the rest masked to
    0 (contiguous columns, so the loads stay vectorised; M < rows only below 16 rows)."""
    if ref.shape[0] == rows:
        return ref[:, pl.ds(col, width)]
    valid = jnp.arange(rows)[:, None] < ref.shape[0]
    return pltriton.load(ref.at[pl.ds(0, rows), pl.ds(col, width)], mask=valid, other=0)


def _kernel(x_ref, w_ref, out_ref, *, block_k: int, steps: int, rows: int, early_launch: bool):
    first = start_dependents(pl.program_id(1), early_launch) * steps

    def step(j, acc):  # x feeds the product as loaded, so Triton pipelines its load with w's
        x = _load_rows(x_ref, rows, pl.multiple_of((first + j) * block_k, block_k), block_k)
        w = w_ref[:, pl.ds(pl.multiple_of(j * block_k, block_k), block_k)]
        return acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, step, jnp.zeros((rows, out_ref.shape[-1]), jnp.float32))
    _store_rows(out_ref, rows, acc.astype(out_ref.dtype))


def _store_rows(ref, rows: int, value, col=None) -> None:
    """value [rows, width] into ref's first rows, at column `col` (None: value is ref's whole width); the rows past
    M (tile padding) masked off."""
    columns = slice(None) if col is None else pl.ds(col, value.shape[-1])
    if ref.shape[0] == rows:
        ref[:, columns] = value
    else:
        valid = jnp.arange(rows)[:, None] < ref.shape[0]
        pltriton.store(ref.at[pl.ds(0, rows), columns], value, mask=valid)


def _tile(size: int, cap: int) -> int:
    """The largest power of two that divides `size`, at most `cap` (tiles never overhang: no edge masks)."""
    return min(cap, size & -size)


def fits_kernel(x_shape, w_shape, block_n: int, block_k: int, max_rows: int) -> bool:
    """At most max_rows rows, and tiles of >= 16 (the smallest tensor-core tile) that divide N and K."""
    (n, k), smallest = w_shape, 16
    return (
        math.prod(x_shape[:-1]) <= max_rows
        and min(block_n, block_k) >= smallest
        and n % block_n == 0
        and k % block_k == 0
    )


def linear_parts_ref(x: jax.Array, w: jax.Array) -> jax.Array:
    """`linear_ref` as one part, [1, ..., N] (`linear_parts_pallas`'s form)."""
    return linear_ref(x, w)[None]


def linear_parts_pallas(x, w, *, tuning: LinearTuning = LinearTuning(), interpret: bool = False):
    """The product as the kernel's K-split partial sums [splits, ..., N], fp32 (or one part in x's dtype when K is
    not split): a consumer that sums them itself (`kernels.residual_norm`) saves the sum's kernel. Rows beyond
    tuning.max_rows, and shapes the tiles do not divide, take `linear_parts_ref`. The tiles are tuning's, cut to
    the largest power of two dividing N and K, so one tuning serves every product of a model."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last axis {x.shape[-1]} does not match w's K={k}")
    block_n, block_k = _tile(n, tuning.block_n), _tile(k, tuning.block_k)
    if not fits_kernel(x.shape, w.shape, block_n, block_k, tuning.max_rows):
        return linear_parts_ref(x, w)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    splits = tuning.splits or default_splits(n, k, block_n, block_k, tuning)
    steps = k // block_k // splits
    if steps * splits * block_k != k:
        raise ValueError(f"splits={splits} does not divide K={k} into block_k={block_k} steps")
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, steps=steps, rows=pl.next_power_of_2(max(m, 16)),
                          early_launch=not interpret),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec(x2.shape, lambda i, s: (0, 0)),
                  pl.BlockSpec((block_n, steps * block_k), lambda i, s: (i, s))],
        out_specs=pl.BlockSpec((None, m, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="linear",
    )(x2, w)  # fmt: skip
    return out.reshape(splits, *lead, n)


def linear_pallas(x, w, *, tuning: LinearTuning = LinearTuning(), interpret: bool = False):
    """Pallas form of `linear_ref` (same layouts and rounding; fp32 sums in a different order): the partial sums
    of `linear_parts_pallas`, added by XLA, which fuses the sum into the consumer."""
    parts = linear_parts_pallas(x, w, tuning=tuning, interpret=interpret)
    return (parts[0] if parts.shape[0] == 1 else parts.sum(axis=0)).astype(x.dtype)
