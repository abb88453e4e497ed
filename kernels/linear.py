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
With `partials=True` the product returns those fp32 sums unadded and unrounded, [splits, ..., N] ([1, ..., N]
from XLA's dot), for a consumer that adds them itself: the residual add of `kernels.residual_norm`.
With `glu_out=True` the weight is the fused MLP's [gate; up] ([2I, K]) and the result silu_mul(gate, up) [M, I].
With GLU_EPILOGUE each program multiplies the same block_n columns of both halves over all of K and applies the
activation as its epilogue, so the activation is not an XLA kernel of its own between the gate/up and down
products (32 kernels a 4B batch-1 step, session-7 profile); measured slower (GLU_EPILOGUE notes), so by default
the plain kernel multiplies and XLA applies the activation.
Only M <= MAX_ROWS goes to the kernel: from 64 rows on XLA's GEMMs, which tile M, were measured faster (MAX_ROWS
notes). Shapes with N or K not a multiple of 16 go to `linear_ref` too.

The RMSNorm and the MLP activation before a product were tried inside this kernel, applied to x as it loads
it (session 7: 175 fewer kernels a batch-1 step, but products 15-40% slower, since Triton does not pipeline a
load that is computed on; engine batch 1 3.18 against 3.08 ms). That path was removed in session 9, when the
model stopped handing the products its norms (`model.Residual`); docs/performance.md keeps the figures, git
history (b9e86f3) the code.
Rows: x keeps its M rows (no padding copy); the kernel's tiles have `rows` (16 or 32) rows, loaded and stored
with the rows past M masked (contiguous columns, so the loads stay vectorised).
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
# The gate/up product with the activation as its epilogue (glu_out) reads two [block_n, block_k] tiles a step, one of
# each half of the weight. Measured on the H200 (session 9, 4B, engine TPOT batch 1 / 32, the same call): the plain
# kernel with XLA's activation after it 3.08 / 4.60 ms (with XLA's add and norm); the epilogue with block_n 16
# (576 programs, the plain kernel's bytes a step) 3.42 ms at batch 1, and block_n 32 3.19 / 4.86 ms (both with the
# add_norm kernel, whose own cost is 3.21 / 4.82 without the epilogue). Batch-1 profile: the epilogue product 1.00
# ms a step against 0.82 + 0.05 ms for the plain product and XLA's activation. So it is off (GLU_EPILOGUE): glu_out
# then multiplies by the plain kernel and lets XLA apply the activation, as before the epilogue existed.
GLU_OUT_BLOCK_N = 32
GLU_EPILOGUE = False
NUM_WARPS = 4
NUM_STAGES = 3
TARGET_PROGRAMS = 4 * 132  # four programs an SM on the H200's 132: enough loads in flight to cover HBM latency
MIN_STEPS = 4  # block_k steps a program at least (a longer loop pipelines its loads better)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The MLP's activation: silu(gate) rounded to the model dtype, times up (the exact product of two bf16
    values fits fp32, so this rounds once, as a bf16 multiply does)."""
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return (act.astype(jnp.float32) * up.astype(jnp.float32)).astype(up.dtype)


def linear_ref(x: jax.Array, w: jax.Array, *, partials: bool = False, glu_out: bool = False) -> jax.Array:
    """x [..., K] @ w[N, K]^T with fp32 accumulation, x's dtype out (XLA's dot). partials: the fp32 sums unrounded,
    as [1, ..., N]. glu_out: w is the MLP's [gate; up] and the result silu_mul(gate, up), [..., N / 2] (module
    notes)."""
    out = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if glu_out:
        return silu_mul(*jnp.split(out.astype(x.dtype), 2, axis=-1))
    return out[None] if partials else out.astype(x.dtype)


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


def _load_rows(ref, rows: int, col, width: int):
    """ref's [rows, width] block at column `col`: the first rows of the tile are x's M rows, the rest masked to
    0 (contiguous columns, so the loads stay vectorised; M < rows only below 16 rows)."""
    if ref.shape[0] == rows:
        return ref[:, pl.ds(col, width)]
    valid = jnp.arange(rows)[:, None] < ref.shape[0]
    return pltriton.load(ref.at[pl.ds(0, rows), pl.ds(col, width)], mask=valid, other=0)


def _kernel(x_ref, w_ref, out_ref, *, block_k: int, steps: int, rows: int):
    first = pl.program_id(1) * steps

    def step(j, acc):  # x feeds the product as loaded, so Triton pipelines its load with w's
        x = _load_rows(x_ref, rows, pl.multiple_of((first + j) * block_k, block_k), block_k)
        return acc + _times_rows(x, w_ref[:, pl.ds(pl.multiple_of(j * block_k, block_k), block_k)])

    acc = lax.fori_loop(0, steps, step, jnp.zeros((rows, out_ref.shape[-1]), jnp.float32))
    _store_rows(out_ref, rows, acc.astype(out_ref.dtype))


def _times_rows(x, w):
    """x [rows, block_k] @ w [block_n, block_k]^T on the tensor cores, fp32 sums."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _store_rows(ref, rows: int, value) -> None:
    """value [rows, width] into ref's first rows; the rows past M (tile padding) masked off."""
    if ref.shape[0] == rows:
        ref[...] = value
    else:
        valid = jnp.arange(rows)[:, None] < ref.shape[0]
        pltriton.store(ref.at[pl.ds(0, rows), :], value, mask=valid)


def _glu_out_kernel(x_ref, gate_ref, up_ref, out_ref, *, block_k: int, steps: int, rows: int):
    """One program: the gate and up columns of the same block_n outputs, over all of K, then the activation."""

    def step(j, accs):
        cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        x = _load_rows(x_ref, rows, cols.start, block_k)
        return tuple(acc + _times_rows(x, ref[:, cols]) for acc, ref in zip(accs, (gate_ref, up_ref), strict=True))

    zeros = jnp.zeros((rows, out_ref.shape[-1]), jnp.float32)
    gate, up = lax.fori_loop(0, steps, step, (zeros, zeros))
    act = silu_mul(gate.astype(out_ref.dtype), up.astype(out_ref.dtype))  # the rounding of linear_ref's glu_out
    _store_rows(out_ref, rows, act)


def _glu_out_call(x2, w, block_n: int, block_k: int, num_warps, num_stages, interpret):
    """silu_mul(x2 @ gate^T, x2 @ up^T) with w = [gate; up]: grid (N / 2 / block_n,), no K split (the
    activation needs whole sums); the two halves of w are read through two block specs of the same array."""
    (m, k), half = x2.shape, w.shape[0] // 2
    offset = half // block_n
    return pl.pallas_call(
        functools.partial(_glu_out_kernel, block_k=block_k, steps=k // block_k, rows=pl.next_power_of_2(max(m, 16))),
        grid=(half // block_n,),
        in_specs=[pl.BlockSpec(x2.shape, lambda i: (0, 0)), pl.BlockSpec((block_n, k), lambda i: (i, 0)),
                  pl.BlockSpec((block_n, k), lambda i: (i + offset, 0))],
        out_specs=pl.BlockSpec((m, block_n), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((m, half), x2.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                                num_stages=num_stages or NUM_STAGES),
        interpret=interpret,
        name="linear_glu_out",
    )(x2, w, w)  # fmt: skip


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


def linear_pallas(x, w, *, partials: bool = False, glu_out: bool = False, block_n=None, block_k=None, splits=None,
                  num_warps=None, num_stages=None, interpret=False):  # fmt: skip
    """Pallas form of `linear_ref` (same layouts and rounding; fp32 sums in a different order). Rows beyond
    MAX_ROWS, and shapes the tiles do not divide, take `linear_ref`. block_n / block_k / splits / num_warps /
    num_stages: tiling, for sweeps (None: the defaults above, cut to the largest power of two dividing N and K;
    splits from `default_splits`). An explicit block_n / block_k that does not divide N / K is an error, not a
    silent fallback: a sweep must not time XLA's product under the kernel's name."""
    n, k = w.shape
    for given, size, name in ((block_n, n // 2 if glu_out else n, "block_n"), (block_k, k, "block_k")):
        if given and size % given:  # glu_out: block_n tiles each half of w
            raise ValueError(f"{name}={given} does not divide {size}")
    if x.shape[-1] != k:
        raise ValueError(f"x's last axis {x.shape[-1]} does not match w's K={k}")
    block_n = block_n or _tile(n // 2 if glu_out else n, GLU_OUT_BLOCK_N if glu_out else BLOCK_N)
    block_k = block_k or _tile(k, BLOCK_K)
    if glu_out:
        return _linear_glu_out(x, w, block_n, block_k, num_warps, num_stages, interpret)
    if not fits_kernel(x.shape, w.shape, block_n, block_k):
        return linear_ref(x, w, partials=partials)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    splits = splits or default_splits(n, k, block_n, block_k)
    steps = k // block_k // splits
    if steps * splits * block_k != k:
        raise ValueError(f"splits={splits} does not divide K={k} into block_k={block_k} steps")
    out_dtype = x.dtype if splits == 1 and not partials else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, steps=steps, rows=pl.next_power_of_2(max(m, 16))),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec(x2.shape, lambda i, s: (0, 0)),
                  pl.BlockSpec((block_n, steps * block_k), lambda i, s: (i, s))],
        out_specs=pl.BlockSpec((None, m, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                                num_stages=num_stages or NUM_STAGES),
        interpret=interpret,
        name="linear",
    )(x2, w)  # fmt: skip
    if partials:
        return out.reshape(splits, *lead, n)
    out = out[0] if splits == 1 else out.sum(axis=0)
    return out.astype(x.dtype).reshape(*lead, n)


def _linear_glu_out(x, w, block_n: int, block_k: int, num_warps, num_stages, interpret):
    """linear_pallas(..., glu_out=True) (the reference where the kernel does not fit)."""
    if w.shape[0] % 2 or not fits_kernel(x.shape, (w.shape[0] // 2, w.shape[1]), block_n, block_k):
        return linear_ref(x, w, glu_out=True)
    if not GLU_EPILOGUE:  # the plain kernel, then XLA's activation: the same numbers (GLU_EPILOGUE notes)
        gate_up = linear_pallas(x, w, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
        return silu_mul(*jnp.split(gate_up, 2, axis=-1))
    x2 = x.reshape(-1, x.shape[-1])
    out = _glu_out_call(x2, w, block_n, block_k, num_warps, num_stages, interpret)
    return out.reshape(*x.shape[:-1], w.shape[0] // 2)
