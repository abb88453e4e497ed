"""The decode step's weight products: y = x @ W^T for a few token rows, read at HBM bandwidth.

Math: y[m, n] = sum_k x[m, k] * w[n, k], fp32 accumulation, rounded to x's dtype (`model.matmul`).
Layouts: x [M, K] (model dtype), w [N, K] (HF's [out, in]), y [M, N] (x's dtype).

Why a kernel: a decode step at small batch is a chain of weight GEMVs, and their time is the weight bytes over
HBM bandwidth. XLA's Triton GEMM emitter leaves them at 34-70% of the H200's bandwidth, by shape and batch,
with no form or backend winning everywhere (`tools/bench_linear.py`, docs/performance.md, session 5); with
the emitter off, cuBLAS is slower still.

Pallas kernel (Triton lowering): grid (N / block_n, splits). Program (i, s) owns output columns
i*block_n .. +block_n and the s-th of `splits` equal K ranges; it walks its range in block_k steps, each a
[rows, block_k] x [block_k, block_n] tensor-core product (rows = M padded to a multiple of 16, the smallest
tensor-core tile; x is tiny and read from L2 by every program), accumulating in fp32. The tiles are powers of
two that divide N and K (4B: block_n 32, block_k 128 everywhere). Splitting K gives a
narrow weight (N = 2560 at 4B) enough programs to keep every SM's loads in flight; the splits' fp32 partial
sums [splits, M, N] are added by XLA, which fuses the sum into the consumer where it can.
Only M <= MAX_ROWS goes to the kernel: from 64 rows on XLA's GEMMs, which tile M, were measured faster (MAX_ROWS
notes). Shapes with N or K not a multiple of 16 go to `linear_ref` too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Decode batches up to this go to the kernel. On the H200 (4B, session 6) the kernel wins at batch 1 and 16 (engine
# TPOT 3.21 / 3.79 ms against 4.96 / 4.89 ms with XLA's products) and loses at 64 (6.35 against 5.98 ms; the
# device-trace sweep agrees: XLA's GEMMs 3-13% faster per product at 64 rows). 32 is between, unmeasured.
MAX_ROWS = 32
# The best tiling at every 4B product at batch 1 and 64 in the session-6 sweep (tools/bench_linear.py, device
# trace; docs/kernels.md): block_n 32 / block_k 128 / 3 stages, 64-79% of HBM bandwidth at batch 1 where
# session 5's 64 / 256 / 3 reached 58-69%.
BLOCK_N = 32
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 3
TARGET_PROGRAMS = 4 * 132  # four programs an SM on the H200's 132: enough loads in flight to cover HBM latency
MIN_STEPS = 4  # block_k steps a program at least (a longer loop pipelines its loads better)


def linear_ref(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w[N, K]^T with fp32 accumulation, x's dtype out (XLA's dot)."""
    out = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def default_splits(n: int, k: int, block_n: int, block_k: int) -> int:
    """The fewest K splits that reach TARGET_PROGRAMS programs, keeping >= MIN_STEPS block_k steps each and
    dividing K's steps evenly."""
    steps = k // block_k
    best = 1
    for splits in range(1, steps + 1):
        if steps % splits or steps // splits < MIN_STEPS:
            continue
        best = splits
        if (n // block_n) * splits >= TARGET_PROGRAMS:
            break
    return best


def _kernel(x_ref, w_ref, out_ref, *, block_k: int, steps: int):
    first = pl.program_id(1) * steps

    def body(j, acc):
        x = x_ref[:, pl.ds(pl.multiple_of((first + j) * block_k, block_k), block_k)]
        w = w_ref[:, pl.ds(pl.multiple_of(j * block_k, block_k), block_k)]
        return acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    rows, block_n = out_ref.shape
    out_ref[...] = lax.fori_loop(0, steps, body, jnp.zeros((rows, block_n), jnp.float32)).astype(out_ref.dtype)


def _tile(size: int, cap: int) -> int:
    """The largest power of two that divides `size`, at most `cap` (tiles never overhang: no edge masks)."""
    return min(cap, size & -size)


def fits_kernel(x_shape, w_shape, block_n: int, block_k: int) -> bool:
    """At most MAX_ROWS rows, and tiles of >= 16 (the smallest tensor-core tile) that divide N and K."""
    (n, k), smallest = w_shape, 16
    return (
        math.prod(x_shape[:-1]) <= MAX_ROWS
        and min(block_n, block_k) >= smallest
        and n % block_n == 0
        and k % block_k == 0
    )


def linear_pallas(x, w, *, block_n=None, block_k=None, splits=None, num_warps=None, num_stages=None,
                  interpret=False):  # fmt: skip
    """Pallas form of `linear_ref` (same layouts and rounding; fp32 sums in a different order). Rows beyond
    MAX_ROWS, and shapes the tiles do not divide, take `linear_ref`. block_n / block_k / splits / num_warps /
    num_stages: tiling, for sweeps (None: the defaults above, cut to the largest power of two dividing N and K;
    splits from `default_splits`). An explicit block_n / block_k that does not divide N / K is an error, not a
    silent fallback: a sweep must not time XLA's product under the kernel's name."""
    for given, size, name in ((block_n, w.shape[0], "block_n"), (block_k, w.shape[1], "block_k")):
        if given and size % given:
            raise ValueError(f"{name}={given} does not divide {size}")
    block_n = block_n or _tile(w.shape[0], BLOCK_N)
    block_k = block_k or _tile(w.shape[1], BLOCK_K)
    if not fits_kernel(x.shape, w.shape, block_n, block_k):
        return linear_ref(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    rows = max(16, -(-m // 16) * 16)
    x2 = jnp.pad(x2, ((0, rows - m), (0, 0)))
    splits = splits or default_splits(n, k, block_n, block_k)
    steps = k // block_k // splits
    if steps * splits * block_k != k:
        raise ValueError(f"splits={splits} does not divide K={k} into block_k={block_k} steps")
    out_dtype = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, steps=steps),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((rows, k), lambda i, s: (0, 0)),
                  pl.BlockSpec((block_n, steps * block_k), lambda i, s: (i, s))],
        out_specs=pl.BlockSpec((None, rows, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                                num_stages=num_stages or NUM_STAGES),
        interpret=interpret,
        name="linear",
    )(x2, w)  # fmt: skip
    out = out[0] if splits == 1 else out.sum(axis=0)
    return out[:m].astype(x.dtype).reshape(*lead, n)
