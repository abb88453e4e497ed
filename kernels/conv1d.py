"""Causal depthwise conv1d (kernel K, no bias) + SiLU over the GDN qkv channels, continuing from a conv state.

Math: y[t, c] = silu( sum_{j<K} w[c, j] * x[t - K + 1 + j, c] ), where x before the row's first token comes
from the conv state (the last K-1 inputs seen), or zeros for a fresh sequence. Cross-correlation: no flip.
Rounding follows HF: the conv result is rounded to the model dtype before the SiLU.

Layouts:
    x          [P, T, C'] (prefill) or [B', C'] (one-token update, B' >= B), model dtype, C' >= C: the conv reads x's
               first C columns (and the update its first B rows, B = slots.shape[0]), so the GDN's input projection
               hands over its whole product (conv input, then z, b and a; decode rows first in a step with prefill
               rows) and no copy slices the conv's columns or rows out of it for the kernel
    weight     [C, K] model dtype
    conv_state [rows, K-1, C] model dtype, oldest input first (zeros for a fresh sequence)
    lengths    [P] valid tokens per row
Returns y ([P, T, C] or [B, C], model dtype) and each row's new conv state: its last K-1 valid inputs.

Pallas kernels (Triton lowering). Channels are independent (depthwise), so both kernels block over them;
channel rows are contiguous in memory, which makes every load and store a coalesced vector.
- update, in the slot pool (below): grid (B, C / block_c). A program reads its K-1 state rows and the new input
  for block_c channels, writes y and the shifted state. 4B: C = 8192, block_c 512, so B * 16 programs of 8 KiB
  traffic each.
- prefill: grid (P, T / block_t, C / block_c), one [block_t, block_c] output tile a program. Tap j reads
  the tile shifted by j - (K-1) tokens; rows before the chunk start come from the conv state (a masked
  load selects which), so there is no sequential dependency across tiles and every tile runs in parallel.
  The overlapping tap reads hit L1/L2: DRAM traffic stays ~ one read of x and one write of y. The t = 0
  tile's program also writes the row's new conv state, window rows length .. length + K-2.
y is computed at padding tokens too (from whatever x holds there), exactly as the reference does.
Block sizes are the largest powers of two (up to the tuning's block_t, block_c) that divide T and C, so tiles
never overhang the arrays and need no edge masks (the engine's chunk buckets and the model's C are powers of two
or multiples of 512). The prefill's new conv state goes to a fresh buffer, not in place over the old one: the
state rows shift by one, so an element would be read by one thread and overwritten by another, and Triton
gives no barrier between them; the buffer is K-1 rows, small next to x.
The block sizes and warp counts (`ConvUpdateTuning`, `ConvPrefillTuning`) are unmeasured first choices;
`tools/bench_conv1d.py --sweep` times others.

In-pool update (`causal_conv1d_update_pool_ref`, `causal_conv1d_update_pool_pallas`): the one-token update reading
and writing the decode rows' states where they live, as the GDN decode does, so a decode step does not gather the
conv states out of the pool and scatter them back (on the H200 that scatter was one 0.29 ms fusion a batch-64
step, touching 229 MB for 38 MB of state):
    pool     [L, S, K-1, C] model dtype: every GDN layer's conv state of every slot
    layer    int32 scalar (may be traced);  slots [B] int32: row b's state is pool[layer, slots[b]]
Returns y and the pool with rows (layer, slots[b]) shifted by the new input; other rows are untouched. The pool
input is aliased to the output. In place is safe here although the rows shift (unlike the prefill's fresh buffer
above): a program loads and stores its columns as [block_c] vectors of one layout, so a column is loaded and
stored by the same thread, loads first. Slots must be distinct except for padding rows sharing the trash slot,
whose contents are then garbage (as in the GDN in-pool kernel; never read for a live sequence).
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


@dataclasses.dataclass(frozen=True)
class ConvUpdateTuning:
    """The update's channels a program (bf16: 4 a thread at 4 warps) and warps."""

    block_c: int = 512
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class ConvPrefillTuning:
    """The prefill's output tile [block_t, block_c] (32 values a thread at 4 warps) and warps."""

    block_t: int = 16
    block_c: int = 256
    num_warps: int = 4


CONV_UPDATE_TUNING = ConvUpdateTuning()
CONV_PREFILL_TUNING = ConvPrefillTuning()


def _conv_silu(window: jax.Array, weight: jax.Array, out_len: int) -> jax.Array:
    """window [rows, K-1+T, C] -> silu(conv) [rows, T, C]."""
    taps = weight.shape[1]
    acc = sum(window[:, j : j + out_len].astype(jnp.float32) * weight[:, j].astype(jnp.float32) for j in range(taps))
    acc = acc.astype(window.dtype).astype(jnp.float32)
    return jax.nn.silu(acc).astype(window.dtype)


def causal_conv1d_prefill_ref(x, weight, conv_state, lengths):
    x = x[..., : weight.shape[0]]
    seq, keep = x.shape[1], conv_state.shape[1]
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
    y = _conv_silu(window, weight, seq)
    new_state = jax.vmap(lambda w, n: lax.dynamic_slice_in_dim(w, n, keep, axis=0))(window, lengths)
    return y, new_state.astype(conv_state.dtype)


def causal_conv1d_update_ref(x, weight, conv_state):
    x = x[..., : weight.shape[0]]
    window = jnp.concatenate([conv_state.astype(x.dtype), x[:, None, :]], axis=1)
    y = _conv_silu(window, weight, 1)[:, 0]
    return y, window[:, 1:].astype(conv_state.dtype)


def _block(size: int, cap: int) -> int:
    """The largest power of two that divides `size`, at most `cap`."""
    return min(cap, size & -size)


def _silu_rounded(acc: jax.Array, dtype) -> jax.Array:
    """fp32 conv sum -> model dtype, rounded before the SiLU as HF does."""
    return jax.nn.silu(acc.astype(dtype).astype(jnp.float32)).astype(dtype)


def _update_window(window: list, weight_ref, y_ref) -> list:
    """window: the K-1 state rows then x, [block_c] each in x's dtype; writes y, returns the new state rows."""
    acc = sum(row.astype(jnp.float32) * weight_ref[:, j].astype(jnp.float32) for j, row in enumerate(window))
    y_ref[...] = _silu_rounded(acc, y_ref.dtype)
    return window[1:]


def causal_conv1d_update_pool_ref(x, weight, pool, layer, slots):
    """`causal_conv1d_update_ref` on the rows pool[layer, slots[b]] and x's first B = slots.shape[0] rows; returns
    (y [B, C], pool with those rows replaced)."""
    y, state = causal_conv1d_update_ref(x[: slots.shape[0]], weight, pool[layer, slots])
    return y, pool.at[layer, slots].set(state)


def _update_pool_kernel(layer_ref, slots_ref, x_ref, weight_ref, pool_ref, y_ref, new_pool_ref, *, early_launch: bool):
    """layer_ref [1], slots_ref [B] int32; pool_ref, new_pool_ref the whole [L, S, K-1, C] pool (one buffer on the
    GPU, aliased); x_ref, y_ref [block_c]; weight_ref [block_c, K]."""
    row, block = start_dependents(pl.program_id(0), early_launch), pl.program_id(1)
    block_c = x_ref.shape[0]
    keep = pool_ref.shape[2]
    layer, slot, columns = layer_ref[0], slots_ref[row], pl.ds(block * block_c, block_c)
    # Every row of the window is a [block_c] vector of one layout, so the thread that loads column c of a state
    # row is the thread that stores column c of the shifted state: each thread's stores follow its own loads of
    # the same addresses, and no thread writes what another still has to read (module notes, in place).
    window = [pool_ref[layer, slot, j, columns].astype(x_ref.dtype) for j in range(keep)] + [x_ref[...]]
    for j, row in enumerate(_update_window(window, weight_ref, y_ref)):
        new_pool_ref[layer, slot, j, columns] = row.astype(new_pool_ref.dtype)


def causal_conv1d_update_pool_pallas(x, weight, pool, layer, slots, *, interpret=False,
                                     tuning: ConvUpdateTuning = CONV_UPDATE_TUNING):  # fmt: skip
    """Pallas version of `causal_conv1d_update_pool_ref` (module notes, in-pool update). Not jitted: the kernel
    set jits it once (kernels.PALLAS)."""
    batch, channels, taps = slots.shape[0], *weight.shape
    assert pool.shape[2:] == (taps - 1, channels) and x.shape[1] >= channels, (x.shape, pool.shape, weight.shape)
    assert x.shape[0] >= batch, (x.shape, slots.shape)
    block_c = _block(channels, tuning.block_c)
    row_spec = pl.BlockSpec((None, block_c), lambda b, c: (b, c))
    whole = pl.BlockSpec(memory_space=pl.ANY)  # the kernel finds its rows from slots
    return pl.pallas_call(
        functools.partial(_update_pool_kernel, early_launch=not interpret),
        grid=(batch, channels // block_c),
        in_specs=[whole, whole, row_spec, pl.BlockSpec((block_c, taps), lambda b, c: (c, 0)), whole],
        out_specs=[row_spec, whole],
        out_shape=[jax.ShapeDtypeStruct((batch, channels), x.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={4: 1},  # pool in -> pool out: only the step's rows are written
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
        interpret=interpret,
        name="conv1d_update_pool",
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(slots, jnp.int32), x, weight, pool)


def _window_rows(x_ref, state_ref, index, columns):
    """Rows `index` of the window [conv state ; x] (any shape of int32 indices) for `columns`, in x's dtype.
    Both loads are clamped in bounds and masked to the side each index falls on."""
    keep, seq = state_ref.shape[0], x_ref.shape[0]
    in_x = index >= keep
    from_x = pltriton.load(x_ref.at[jnp.clip(index - keep, 0, seq - 1), columns], mask=in_x, other=0.0)
    from_state = pltriton.load(state_ref.at[jnp.clip(index, 0, keep - 1), columns], mask=~in_x, other=0.0)
    return jnp.where(in_x, from_x, from_state.astype(x_ref.dtype))


def _prefill_kernel(lengths_ref, x_ref, weight_ref, state_ref, y_ref, new_state_ref, *, block_t: int):
    """lengths_ref []; x_ref, y_ref [T, block_c]; weight_ref [block_c, K]; state_ref, new_state_ref [K-1, block_c]."""
    keep, block_c = state_ref.shape
    columns = jnp.arange(block_c, dtype=jnp.int32)
    t0 = pl.program_id(1) * block_t
    times = (t0 + jnp.arange(block_t, dtype=jnp.int32))[:, None]  # [block_t, 1]; window row t + j is tap j
    acc = sum(
        _window_rows(x_ref, state_ref, times + j, columns[None, :]).astype(jnp.float32)
        * weight_ref[:, j].astype(jnp.float32)[None, :]
        for j in range(keep + 1)
    )
    y_ref[pl.ds(t0, block_t), :] = _silu_rounded(acc, y_ref.dtype)

    @pl.when(pl.program_id(1) == 0)
    def _():
        length = lengths_ref[...]
        for i in range(keep):
            row = _window_rows(x_ref, state_ref, length + i, columns)
            new_state_ref[i, :] = row.astype(new_state_ref.dtype)


def causal_conv1d_prefill_pallas(x, weight, conv_state, lengths, *, interpret=False,
                                 tuning: ConvPrefillTuning = CONV_PREFILL_TUNING):  # fmt: skip
    """Pallas version of `causal_conv1d_prefill_ref` (same arguments and result; module notes)."""
    (rows, seq, width), (channels, taps) = x.shape, weight.shape
    assert width >= channels, (x.shape, weight.shape)
    block_t, block_c = _block(seq, tuning.block_t), _block(channels, tuning.block_c)
    seq_spec = pl.BlockSpec((None, seq, block_c), lambda p, t, c: (p, 0, c))
    state_spec = pl.BlockSpec((None, taps - 1, block_c), lambda p, t, c: (p, 0, c))
    return pl.pallas_call(
        functools.partial(_prefill_kernel, block_t=block_t),
        grid=(rows, seq // block_t, channels // block_c),
        in_specs=[
            pl.BlockSpec((None,), lambda p, t, c: (p,)),
            seq_spec,
            pl.BlockSpec((block_c, taps), lambda p, t, c: (c, 0)),
            state_spec,
        ],
        out_specs=[seq_spec, state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((rows, seq, channels), x.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        ],  # fmt: skip
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
        interpret=interpret,
        name="conv1d_prefill",
    )(lengths.astype(jnp.int32), x, weight, conv_state)
