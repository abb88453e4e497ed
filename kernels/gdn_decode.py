"""Gated DeltaNet one-token recurrent decode for a batch of slots, updating the state pool in place.

Math (per row b and value head h; key head h // ratio; S in R^{dk x dv}, fp32):
    q, k <- l2norm(q), l2norm(k) (eps 1e-6);  q <- q * dk^-0.5
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q

Layouts:
    q, k        [B, nk, dk]   model dtype (after conv + SiLU)
    v           [B, nv, dv]   model dtype
    g           [B, nv]       fp32;  beta [B, nv] model dtype
    pool        [L, S, nv, dk, dv] fp32 or bf16 (storage only: the math is fp32): every GDN layer's recurrent
                state of every slot
    layer       int32 scalar (may be traced): which layer of the pool this call updates
    slots       [B] int32, 0 <= slots[b] < S: row b's state is pool[layer, slots[b]]; the last slot (S - 1) is the
                trash slot (`trash_slot`: another index, or None for none), and a row there is padding: its o is 0
                and its state is neither read nor written
Returns o [B, nv, dv] in v's dtype and the pool with rows (layer, slots[b]) replaced by the new states; every other
row, the trash slot's included, is left as it was (the kernel never touches it: bit-identical). `gdn_decode_ref` is the same step on gathered
states [B, nv, dk, dv] (the pool reference and the prefill tests' token-by-token oracle).

The engine calls the gated form (`gdn_decode_pool_gated_*`): the same step, each program making its row's and head's
gates g and beta (`gdn_gates`) from the in_proj's b and a columns, read where the product wrote them, and the
layer's A_log and dt_bias. XLA ran two small kernels a GDN layer for the gates otherwise: the 4B batch-1 step has 424
commands with the gates in the kernel against 472 (`tools/deviceless_step.py --key 1,0,0`).

Why in the pool: reading and writing the step's rows where they live, the states cross HBM once a step (read +
write) instead of three times (gather, kernel, scatter). The Pallas kernel aliases the pool input to the pool
output, so under jit with the pool donated (or carried in a loop) the update happens in place and no copy of the
pool is made; without donation XLA copies the pool first to honour the alias.

Pallas kernel (Triton lowering): grid (B, nv, dv / block_dv). One program owns the column block
S[:, block] of one (row, value head): it reads q and k of key head h // ratio whole (dk values, so every
program can l2norm them itself; that is 2 dk loads against dk * block_dv state loads), reads its state
tile [dk, block_dv] once, applies decay, delta update and readout in registers, and writes the tile back.
Columns of S are independent in the update (u[e] needs only column e of S), so splitting dv costs nothing but
the repeated l2norm, and gives B * nv * dv / block_dv programs: 64 at B = 1 on the 4B model (32 value heads),
4096 at B = 64, where one program per head would leave the H200's 132 SMs mostly idle at small batches. The
kernel is memory bound: 2 * 4 * dk * dv bytes of state per head against ~7 dk dv FLOPs.
In place is safe: each tile is read and written by one program only, and the stored S[d, e] depends on
u[e], a reduction over the loaded column e, so every load of a column completes before any store to it.
Slots must be distinct, except that padding rows all point at the trash slot (the pool's last slot, as the
engine lays its pools out). Those rows are skipped: a bucket padded from 1 row to 64 would otherwise read and
write the one trash tile from 63 rows' programs at once, which on the H200 cost a 4B decode step 1.4 ms
(docs/performance.md), and their results are never read.
The pool can exceed 2^31 elements (4B, 256 slots: 24 x 257 x 32 x 128 x 128 fp32 = 3.4e9 elements, 12.9 GB),
so element offsets into it must be 64-bit. The kernel indexes its pl.ANY pool ref with scalars (layer,
slots[b], head) and slices, as the paged attention kernels index their page pools: the Triton lowering then
widens every index to int64 before multiplying by its stride whenever the array is larger than 2^32 bytes
(`_compute_offsets_from_indices` in jax/_src/pallas/triton/lowering.py); smaller pools keep int32 offsets,
which cannot overflow there (at most 2^30 fp32 or 2^31 bf16 elements). tests/test_kernels_gdn_decode.py checks the int64
address arithmetic in the lowered Triton IR at 4B shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qwen35_jax.kernels.device import start_dependents
from qwen35_jax.kernels.gdn_prefill import prepare_qk, split_packed_heads

EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class GdnDecodeTuning:
    """The state tile's columns a program, block_dv (a [128, 64] fp32 tile is 128 registers a thread at 2 warps),
    and warps. Best of the H200 sweep (`tools/bench_gdn_decode.py --sweep`) at batch 64: 83.8 us, 75% of 4.3 TB/s."""

    block_dv: int = 64
    num_warps: int = 2


GDN_DECODE_TUNING = GdnDecodeTuning()
POOL_DTYPES = (jnp.float32, jnp.bfloat16)  # the state's storage (`cache.SSM_DTYPES`); the step is fp32 either way


def gdn_decode_ref(q, k, v, g, beta, state):
    """The step on gathered states [B, nv, dk, dv] fp32 -> (o [B, nv, dv] in v's dtype, the new states)."""
    q, k = prepare_qk(q, k, v.shape[-2])
    state = state * jnp.exp(g.astype(jnp.float32))[..., None, None]
    v32 = v.astype(jnp.float32)
    u = beta.astype(jnp.float32)[..., None] * (v32 - jnp.einsum("bhde,bhd->bhe", state, k))
    state = state + k[..., :, None] * u[..., None, :]
    out = jnp.einsum("bhde,bhd->bhe", state, q)
    return out.astype(v.dtype), state


def gdn_gates(a, b, a_log, dt_bias):
    """The GDN's decay and write strength from its in_proj columns a and b: g = -exp(A_log) softplus(a + dt_bias)
    (fp32) and beta = sigmoid(b) (b's dtype), as HF's Qwen3.5 computes them. Written with exp and log1p alone, so
    that the decode kernel makes them from the same code (elementwise; any shapes that broadcast)."""
    x = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    softplus = jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))
    beta = 1.0 / (1.0 + jnp.exp(-b.astype(jnp.float32)))
    return -jnp.exp(a_log.astype(jnp.float32)) * softplus, beta.astype(b.dtype)


def gated_rms_norm(x, weight, gate, eps: float):
    """The GDN output norm (HF's Qwen3.5 RMSNormGated): w * round(norm(x)) * silu(gate), the weight not zero-centred,
    rounded to x's dtype where HF rounds; x, gate [..., dv], weight [dv]. The decode kernel runs the same code (the
    Triton lowering takes jax.nn.silu's logistic as 1 / (1 + exp(-x)))."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    scaled = (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(x.dtype)
    return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x) + EPS)


def _step(q_ref, k_ref, v_ref, g, beta, state):
    """The fused step on one state tile: q_ref, k_ref [dk]; v_ref [block]; g, beta fp32 scalars; state [dk, block]
    fp32 -> (o [block] fp32, new state tile)."""
    q = _l2norm(q_ref[...].astype(jnp.float32)) * (q_ref.shape[0] ** -0.5)
    k = _l2norm(k_ref[...].astype(jnp.float32))
    state = state * jnp.exp(g)
    u = beta * (v_ref[...].astype(jnp.float32) - jnp.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * u[None, :]
    return jnp.sum(state * q[:, None], axis=0), state


def _tiling(q, v, block_dv: int):
    """(grid (B, nv, dv / block_dv), (key, value, per-head) BlockSpecs) of the kernel."""
    batch, num_value_heads, dv = v.shape
    dk = q.shape[-1]
    ratio = num_value_heads // q.shape[1]
    block_dv = min(block_dv, dv)
    assert dk & (dk - 1) == 0, f"dk={dk}: Triton loads need a power of two"
    assert block_dv & (block_dv - 1) == 0 and dv % block_dv == 0, f"dv={dv} is not a multiple of {block_dv=}"
    key_spec = pl.BlockSpec((None, None, dk), lambda b, h, j: (b, h // ratio, 0))
    value_spec = pl.BlockSpec((None, None, block_dv), lambda b, h, j: (b, h, j))
    head_spec = pl.BlockSpec((None, None), lambda b, h, j: (b, h))
    return (batch, num_value_heads, dv // block_dv), (key_spec, value_spec, head_spec)


def _trash(pool, trash_slot):
    """The trash slot's index (its default: the pool's last slot), or -1 (no slot) for None."""
    if trash_slot is None:
        return -1
    return pool.shape[1] - 1 if trash_slot == "last" else trash_slot


def gdn_decode_pool_ref(q, k, v, g, beta, pool, layer, slots, trash_slot="last"):
    """`gdn_decode_ref` on the rows pool[layer, slots[b]]; returns (o, pool with those rows replaced). Rows at
    `trash_slot` (by default the last; None: none) are padding: o 0, and the trash slot keeps its state. The pool
    is fp32 or bf16 (`cache.SSM_DTYPES`); the step computes in fp32 and stores the new state in the pool's type."""
    rows = pool[layer, slots]
    o, state = gdn_decode_ref(q, k, v, g, beta, rows.astype(jnp.float32))
    padding = slots == _trash(pool, trash_slot)
    o = jnp.where(padding[:, None, None], jnp.zeros((), o.dtype), o)
    return o, pool.at[layer, slots].set(jnp.where(padding[:, None, None, None], rows, state.astype(pool.dtype)))


def _decode_tile(layer_ref, slots_ref, q_ref, k_ref, v_ref, g, beta, pool_ref, o_ref, new_pool_ref, trash: int,
                 early_launch: bool, finish=None):  # fmt: skip
    """layer_ref [1], slots_ref [B] int32; q_ref, k_ref [dk]; v_ref, o_ref [block_dv]; g, beta fp32 scalars;
    pool_ref, new_pool_ref the whole [L, S, nv, dk, dv] pool (one buffer on the GPU, aliased); finish: o [block_dv]
    in o_ref's dtype -> what o_ref stores (the output norm), or None."""
    row, head, block = start_dependents(pl.program_id(0), early_launch), pl.program_id(1), pl.program_id(2)
    block_dv = o_ref.shape[0]
    # This program's tile pool[layer, slots[row], head, :, block]. Scalar indices into the pl.ANY ref: the
    # lowering turns them into offsets index * stride, in int64 once the pool passes 2^32 bytes (module notes).
    # Reading the input ref and writing the output ref is right both compiled (one buffer, each tile read and
    # written by its own program only) and in interpret mode (the output starts as a copy of the input).
    slot = slots_ref[row]
    padding = slot == trash  # module notes

    @pl.when(jnp.logical_not(padding))
    def _():
        tile = (layer_ref[0], slot, head, slice(None), pl.ds(block * block_dv, block_dv))
        o, state = _step(q_ref, k_ref, v_ref, g, beta, pool_ref[tile].astype(jnp.float32))
        new_pool_ref[tile] = state.astype(new_pool_ref.dtype)
        o = o.astype(o_ref.dtype)
        o_ref[...] = o if finish is None else finish(o)

    @pl.when(padding)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _pool_decode_kernel(layer_ref, slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref, new_pool_ref, *,
                        trash: int, early_launch: bool):  # fmt: skip
    """g_ref, beta_ref []: the row's and head's gates, given."""
    g, beta = g_ref[...], beta_ref[...].astype(jnp.float32)
    _decode_tile(layer_ref, slots_ref, q_ref, k_ref, v_ref, g, beta, pool_ref, o_ref, new_pool_ref, trash, early_launch)


def _gated_pool_decode_kernel(layer_ref, slots_ref, q_ref, k_ref, v_ref, b_ref, a_ref, a_log_ref, dt_bias_ref,
                              pool_ref, o_ref, new_pool_ref, *, trash: int, early_launch: bool):  # fmt: skip
    """b_ref, a_ref []: the row's in_proj b and a of this head; a_log_ref, dt_bias_ref []: the head's parameters.
    The gates are made here (`gdn_gates`), so they cost no kernels of their own."""
    g, beta = gdn_gates(a_ref[...], b_ref[...], a_log_ref[...], dt_bias_ref[...])
    _decode_tile(layer_ref, slots_ref, q_ref, k_ref, v_ref, g, beta.astype(jnp.float32), pool_ref, o_ref,
                 new_pool_ref, trash, early_launch)  # fmt: skip


def _gated_normed_pool_decode_kernel(layer_ref, slots_ref, q_ref, k_ref, v_ref, b_ref, a_ref, a_log_ref, dt_bias_ref,
                                     z_ref, norm_weight_ref, pool_ref, o_ref, new_pool_ref, *, trash: int, eps: float,
                                     early_launch: bool):  # fmt: skip
    """`_gated_pool_decode_kernel` with the output norm applied to the head's whole o (block_dv = dv): z_ref [dv] the
    row's and head's gate columns of the in_proj's output, norm_weight_ref [dv] (`gated_rms_norm`). A padding row's
    o stays 0, as the norm of a zero o is 0."""
    g, beta = gdn_gates(a_ref[...], b_ref[...], a_log_ref[...], dt_bias_ref[...])
    _decode_tile(layer_ref, slots_ref, q_ref, k_ref, v_ref, g, beta.astype(jnp.float32), pool_ref, o_ref,
                 new_pool_ref, trash, early_launch, finish=lambda o: gated_rms_norm(o, norm_weight_ref[...], z_ref[...], eps))  # fmt: skip


def gdn_decode_pool_pallas(q, k, v, g, beta, pool, layer, slots, trash_slot="last", *, interpret=False,
                           tuning: GdnDecodeTuning = GDN_DECODE_TUNING):  # fmt: skip
    """Pallas version of `gdn_decode_pool_ref` (same arguments and result; module notes for the aliasing and
    the trash slot). Not jitted: the kernel set jits it once (kernels.PALLAS)."""
    _, num_value_heads, dv = v.shape
    assert pool.dtype in POOL_DTYPES and pool.shape[2:] == (num_value_heads, q.shape[-1], dv), (pool.shape, pool.dtype)
    grid, (key_spec, value_spec, head_spec) = _tiling(q, v, tuning.block_dv)
    return _pool_call(q, k, v, (g.astype(jnp.float32), beta), pool, layer, slots, trash_slot, grid,
                      (key_spec, key_spec, value_spec), value_spec, (head_spec, head_spec), tuning, interpret)  # fmt: skip


def _pool_call(q, k, v, heads, pool, layer, slots, trash_slot, grid, qkv_specs, out_spec, head_specs, tuning,
               interpret, kernel=_pool_decode_kernel):  # fmt: skip
    """The kernel's pallas_call; q, k, v may be one array under three BlockSpecs (`gdn_decode_pool_packed_pallas`).
    heads: the per-(row, head) inputs under `head_specs` (g and beta, or `_gated_pool_decode_kernel`'s b, a, A_log
    and dt_bias)."""
    whole = pl.BlockSpec(memory_space=pl.ANY)  # no blocking: the kernel computes its pool tile from slots
    batch, num_value_heads = slots.shape[0], pool.shape[2]
    return pl.pallas_call(
        functools.partial(kernel, trash=_trash(pool, trash_slot), early_launch=not interpret),
        grid=grid,
        in_specs=[whole, whole, *qkv_specs, *head_specs, whole],
        out_specs=[out_spec, whole],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_value_heads, pool.shape[-1]), v.dtype),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ],
        input_output_aliases={5 + len(heads): 1},  # pool in -> pool out: only the step's rows are written
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_decode_pool",
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(slots, jnp.int32), q, k, v, *heads, pool)


def split_packed(qkv, pool):
    """q [B, nk, dk], k [B, nk, dk], v [B, nv, dv] of the conv's output qkv [B, 2 nk dk + nv dv] (that order: the
    checkpoint's in_proj_qkv rows), the head geometry read from pool [L, S, nv, dk, dv]."""
    return split_packed_heads(qkv, *pool.shape[2:])


def gdn_decode_pool_packed_ref(qkv, g, beta, pool, layer, slots, trash_slot="last"):
    """`gdn_decode_pool_ref` on the conv's packed output qkv [B, 2 nk dk + nv dv] (`split_packed`)."""
    return gdn_decode_pool_ref(*split_packed(qkv, pool), g, beta, pool, layer, slots, trash_slot)


def gdn_decode_pool_packed_pallas(qkv, g, beta, pool, layer, slots, trash_slot="last", *, interpret=False,
                                  tuning: GdnDecodeTuning = GDN_DECODE_TUNING):  # fmt: skip
    """`gdn_decode_pool_pallas` reading q, k and v where the conv wrote them, in one [B, 2 nk dk + nv dv] array:
    viewed as [B, heads, d] rows of d = dk = dv (a bitcast), each of the three BlockSpecs picks its heads from it.
    Slicing them apart first cost three copy kernels a GDN layer (1 us each at batch 1, ~3% of a 4B step). Head
    dims that differ take the slices."""
    num_value_heads, dk, dv = pool.shape[2:]
    if dk != dv:
        return gdn_decode_pool_pallas(*split_packed(qkv, pool), g, beta, pool, layer, slots, trash_slot,
                                      interpret=interpret, tuning=tuning)  # fmt: skip
    rows, grid, qkv_specs, value_spec, head_spec = _packed_tiling(qkv, pool, tuning)
    return _pool_call(rows, rows, rows, (g.astype(jnp.float32), beta), pool, layer, slots, trash_slot, grid,
                      qkv_specs, value_spec, (head_spec, head_spec), tuning, interpret)  # fmt: skip


def _packed_tiling(qkv, pool, tuning: GdnDecodeTuning):
    """(qkv viewed as [B, heads, d] rows, grid, q / k / v BlockSpecs into the rows, the output's and a per-head
    input's BlockSpecs) of the packed kernels (dk = dv)."""
    num_value_heads, dk, dv = pool.shape[2:]
    batch, key_heads = qkv.shape[0], (qkv.shape[-1] - num_value_heads * dv) // (2 * dk)
    q_shape = jax.ShapeDtypeStruct((batch, key_heads, dk), qkv.dtype)  # shapes only, for the tiling
    grid, (_, value_spec, head_spec) = _tiling(q_shape, jax.ShapeDtypeStruct((batch, num_value_heads, dv), qkv.dtype),
                                               tuning.block_dv)  # fmt: skip
    ratio, block_dv = num_value_heads // key_heads, value_spec.block_shape[-1]
    q_spec = pl.BlockSpec((None, None, dk), lambda b, h, j: (b, h // ratio, 0))
    k_spec = pl.BlockSpec((None, None, dk), lambda b, h, j: (b, key_heads + h // ratio, 0))
    v_spec = pl.BlockSpec((None, None, block_dv), lambda b, h, j: (b, 2 * key_heads + h, j))
    return qkv.reshape(batch, -1, dk), grid, (q_spec, k_spec, v_spec), value_spec, head_spec


def gate_columns(ba, ba_col: int, num_value_heads: int):
    """(a, b) [..., nv]: the in_proj's b at columns [ba_col, ba_col + nv) of ba, a right after it."""
    return (ba[..., ba_col + num_value_heads : ba_col + 2 * num_value_heads],
            ba[..., ba_col : ba_col + num_value_heads])  # fmt: skip


def _output_norm(out, z, z_col: int, norm_weight, eps: float):
    """`gated_rms_norm` of out [B, nv, dv] with the gate at columns [z_col, z_col + nv dv) of z's first B rows."""
    batch, heads, dim = out.shape
    return gated_rms_norm(out, norm_weight, z[:batch, z_col : z_col + heads * dim].reshape(out.shape), eps)


def gdn_decode_pool_gated_ref(qkv, ba, ba_col: int, a_log, dt_bias, pool, layer, slots, trash_slot="last", *,
                              z=None, z_col: int = 0, norm_weight=None, eps: float = 1e-6):  # fmt: skip
    """`gdn_decode_pool_packed_ref` with its gates made from the in_proj's output: b at columns [ba_col, ba_col + nv) of
    ba [B', W] (its first B rows: B' >= B = slots.shape[0]), a at [ba_col + nv, ba_col + 2 nv), and the layer's A_log
    and dt_bias [nv] (`gdn_gates`). With norm_weight [dv], o goes through the output norm (`gated_rms_norm`) with the
    gate z at columns [z_col, z_col + nv dv) of z's first B rows (the in_proj's output: z may hold more rows and other
    columns)."""
    g, beta = gdn_gates(*gate_columns(ba[: slots.shape[0]], ba_col, pool.shape[2]), a_log, dt_bias)
    out, pool = gdn_decode_pool_packed_ref(qkv, g, beta, pool, layer, slots, trash_slot)
    return (out if norm_weight is None else _output_norm(out, z, z_col, norm_weight, eps)), pool


def gdn_decode_pool_gated_pallas(qkv, ba, ba_col: int, a_log, dt_bias, pool, layer, slots, trash_slot="last", *,
                                 z=None, z_col: int = 0, norm_weight=None, eps: float = 1e-6, interpret=False,
                                 tuning: GdnDecodeTuning = GDN_DECODE_TUNING):  # fmt: skip
    """`gdn_decode_pool_gated_ref` in one kernel: each program reads its row's b and a where the in_proj wrote them
    (a BlockSpec at column ba_col + head; a slice handed over would be copied first) and makes the gates itself,
    where XLA ran two small kernels a GDN layer for them (48 of a 4B batch-1 step's 472, `tools/deviceless_step.py`).
    With norm_weight and a program over a head's whole o (tuning.block_dv >= dv), the output norm is applied in
    the kernel too, z read in place like b and a (one kernel a GDN layer less); with narrower blocks XLA applies it
    after. Head dims that differ take the gates from XLA and the unpacked kernel."""
    num_value_heads, dk, dv = pool.shape[2:]
    # Only the packed kernel (dk = dv) takes the norm in; the unpacked one for differing head dims leaves it to XLA.
    fused_norm = norm_weight is not None and dk == dv and tuning.block_dv >= dv and z_col % dv == 0
    if dk != dv:
        g, beta = gdn_gates(*gate_columns(ba[: slots.shape[0]], ba_col, num_value_heads), a_log, dt_bias)
        out, pool = gdn_decode_pool_packed_pallas(qkv, g, beta, pool, layer, slots, trash_slot, interpret=interpret,
                                                  tuning=tuning)  # fmt: skip
    else:
        rows, grid, qkv_specs, value_spec, _ = _packed_tiling(qkv, pool, tuning)
        b_spec = pl.BlockSpec((None, None), lambda b, h, j: (b, ba_col + h))
        a_spec = pl.BlockSpec((None, None), lambda b, h, j: (b, ba_col + num_value_heads + h))
        parameter_spec = pl.BlockSpec((None,), lambda b, h, j: (h,))
        heads, head_specs = (ba, ba, a_log, dt_bias), (b_spec, a_spec, parameter_spec, parameter_spec)
        kernel = _gated_pool_decode_kernel
        if fused_norm:
            # z's head h: block z_col / dv + h of dv columns (z_col is a multiple of dv; the row may be wider).
            z_spec = pl.BlockSpec((None, dv), lambda b, h, j: (b, z_col // dv + h))
            weight_spec = pl.BlockSpec((dv,), lambda b, h, j: (0,))
            heads, head_specs = (*heads, z, norm_weight), (*head_specs, z_spec, weight_spec)
            kernel = functools.partial(_gated_normed_pool_decode_kernel, eps=eps)
        out, pool = _pool_call(rows, rows, rows, heads, pool, layer, slots, trash_slot, grid, qkv_specs, value_spec,
                               head_specs, tuning, interpret, kernel=kernel)  # fmt: skip
    if norm_weight is not None and not fused_norm:
        out = _output_norm(out, z, z_col, norm_weight, eps)
    return out, pool
