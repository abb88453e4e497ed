"""Gated DeltaNet chunked prefill, ragged over request rows, continuing from per-slot fp32 state.

Math (per row p and value head h; key head h // ratio; state S in R^{dk x dv}, fp32):
    q, k <- l2norm(q), l2norm(k)  (eps 1e-6, fp32);  q <- q * dk^-0.5
    S_t = exp(g_t) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t);  S_t += k_t u_t^T;  o_t = S_t^T q_t
Chunked form (chunk C = 64, gamma = cumulative sum of g inside the chunk, Gamma_ij = exp(gamma_i - gamma_j), i >= j):
    A = strict_lower((beta K) K^T * Gamma);  U = (I + A)^-1 (beta V);  W = (I + A)^-1 (beta exp(gamma) K)
    per chunk, sequentially: V' = U - W S;  O = (Q exp(gamma)) S + tril((Q K^T) * Gamma) V'
                             S <- exp(gamma_last) S + (K exp(gamma_last - gamma))^T V'

Layouts:
    q, k        [P, T, nk, dk]   model dtype (after conv + SiLU, before l2norm)
    v           [P, T, nv, dv]   model dtype
    g           [P, T, nv]       fp32 (log decay, <= 0)
    beta        [P, T, nv]       model dtype
    state       [P, nv, dk, dv] fp32: each row's recurrent state before the chunk (zeros for a new sequence)
    lengths     [P] int32: valid tokens of each row (the tail is padding)
Returns o [P, T, nv, dv] in q's dtype and each row's state after its last valid token. Padding tokens (index >= length) leave the
state untouched: their beta, g and k are zeroed, which makes each of their updates the identity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from qwen35_jax.kernels.decode_attention import pad_to

CHUNK = 64


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q: jax.Array, k: jax.Array, num_value_heads: int) -> tuple[jax.Array, jax.Array]:
    """fp32 l2norm, the dk^-0.5 query scale, and key-head -> value-head repeat (value head j reads j // ratio)."""
    ratio = num_value_heads // q.shape[-2]
    q = l2norm(q.astype(jnp.float32)) * (q.shape[-1] ** -0.5)
    k = l2norm(k.astype(jnp.float32))
    return jnp.repeat(q, ratio, axis=-2), jnp.repeat(k, ratio, axis=-2)


def _chunk_scan(q, k, v, g, beta, state):
    """q, k [P, H, n, C, dk]; v [P, H, n, C, dv]; g, beta [P, H, n, C]; state [P, H, dk, dv] (all fp32)."""
    size = q.shape[-2]
    lower = jnp.tril(jnp.ones((size, size), dtype=bool))
    gamma = jnp.cumsum(g, axis=-1)
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, gamma[..., :, None] - gamma[..., None, :], 0.0)), 0.0)
    k_beta = k * beta[..., None]
    system = jnp.einsum("phncd,phnkd->phnck", k_beta, k) * decay
    system = jnp.where(jnp.eye(size, dtype=bool), 1.0, jnp.where(lower, system, 0.0))
    new_values = jax.scipy.linalg.solve_triangular(system, v * beta[..., None], lower=True, unit_diagonal=True)
    k_cumdecay = jax.scipy.linalg.solve_triangular(
        system, k_beta * jnp.exp(gamma)[..., None], lower=True, unit_diagonal=True
    )
    intra = jnp.einsum("phncd,phnkd->phnck", q, k) * decay
    q_decayed = q * jnp.exp(gamma)[..., None]
    k_decayed = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]
    chunk_decay = jnp.exp(gamma[..., -1])[..., None, None]

    def step(state, xs):
        u, w, qd, kd, att, cd = xs
        v_new = u - jnp.einsum("phcd,phde->phce", w, state)
        out = jnp.einsum("phcd,phde->phce", qd, state) + jnp.einsum("phck,phke->phce", att, v_new)
        state = state * cd + jnp.einsum("phcd,phce->phde", kd, v_new)
        return state, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
    state, out = lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 2), state


def gdn_chunked_prefill_ref(q, k, v, g, beta, state, lengths):
    num_rows, seq, num_heads, dv = v.shape
    q, k = prepare_qk(q, k, num_heads)
    valid = (jnp.arange(seq)[None, :] < lengths[:, None])[..., None]  # [P, T, 1]
    k = jnp.where(valid[..., None], k, 0.0)
    g = jnp.where(valid, g.astype(jnp.float32), 0.0)
    beta = jnp.where(valid, beta.astype(jnp.float32), 0.0)
    pad = (-seq) % CHUNK
    n = (seq + pad) // CHUNK

    def chunked(x):  # [P, T, H, ...] -> [P, H, n, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(x.shape[:2] + (n, CHUNK) + x.shape[3:])

    out, state = _chunk_scan(chunked(q), chunked(k), chunked(v.astype(jnp.float32)), chunked(g), chunked(beta), state)
    out = jnp.moveaxis(out.reshape(num_rows, num_heads, n * CHUNK, dv), 1, 2)[:, :seq]
    return out.astype(v.dtype), state


# ---------------------------------------------------------------------------------------------------------------------
# Pallas GPU kernel (Triton lowering; `interpret=True` runs it on the CPU).
#
# Following the WY decomposition of the chunked form above, in two variants (`output_pass`). Both start with
#   1. `_wy_prep_kernel`, grid (P, nv, chunks), fully parallel: per chunk and value head it l2-normalises k, masks the
#      padding tokens, takes the cumulative gates gamma and solves (I + A) [W | U] = [beta exp(gamma) K | beta V] by
#      blocked forward substitution over four 16-row blocks (each diagonal block inverted row by row, the blocks below
#      it updated with small matmuls), so neither A nor its inverse ever leaves registers.
# "fused" (two pallas_calls):
#   2. `_state_pass_kernel`, grid (P, nv, dv / block_v): walks the row's valid chunks in order, carrying its fp32 state
#      slice S [dk, block_v] in registers; per chunk it forms V' = U - W S, the output (Q exp(gamma)) S + causal(Q K^T
#      Gamma) V' and the next state. Chunks past a row's length are not computed (their output is written as zeros).
# "parallel" (three pallas_calls, as flash-linear-attention does; the default, faster on the H200): the sequential pass keeps only what must be
# sequential, and the output, Q K^T included (recomputed by every dv slice in "fused"), moves to a parallel pass:
#   2. `_chunk_states_kernel`, grid (P, nv, dv / block_v): the same walk, but per chunk it only stores the chunk's start
#      state S_c ([P, nv, n_chunks, dk, dv] in the operand dtype: n_chunks * dk * dv * 2 bytes per row and value head
#      with dots="bf16", 32 KiB a chunk at dk = dv = 128; fp32 under "tf32" and for fp32 inputs) and V'_c (u's dtype
#      and layout), then steps
#      the state. Chunks past a row's length are skipped and their S_c and V'_c are left unwritten.
#   3. `_chunk_output_kernel`, grid (P, nv, n_chunks, dv / 64): O_c = (Q_c exp(gamma)) S_c + causal(Q_c K_c^T Gamma)
#      V'_c for one chunk and dv slice; chunks past a row's length are written as zeros without reading S_c or V'_c.
#   Both variants round the same operands the same way (V' and S enter their matmuls in the operand dtype either way).
# No jnp glue runs over the activations: l2norm, the query scale and the key-head -> value-head repeat (a BlockSpec
# index map) happen inside the kernels; the only glue is a pad of the token axis up to a multiple of 64 when T is not
# one (the engine's chunk buckets are powers of two >= 16, so only T = 16 or 32 pads, a few KiB).
# Matmul operands (fp32 accumulation throughout) are bf16 for bf16 inputs with `dots="bf16"`, fp32 with TF32 products
# for `dots="tf32"`, and exact fp32 (IEEE) for fp32 inputs; gates, decays, norms, the triangular solve's row steps and
# the state stay fp32.
# ---------------------------------------------------------------------------------------------------------------------

SUB = 16  # rows per diagonal block of the intra-chunk triangular solve


DOTS = ("bf16", "tf32", "ieee")
# "tf32": with "bf16" the 4B golden gate fails on the H200 (26 calibrated misses against a limit of 19.5; with the
# reference GDN prefill in the Pallas set, 12), docs/accuracy.md.
DEFAULT_DOTS = "tf32"
# The WY kernel's defaults, measured on the H200 at 4B heads (session 5, docs/kernels.md): 4 warps and the
# doubling solve take the kernel from 0.099 / 0.788 ms (8 warps, rows) to 0.044 / 0.296 ms at 1k / 8k tokens.
DEFAULT_SOLVE = "doubling"
DEFAULT_PREP_WARPS = 4


def _dot(a, b, dots: str, contract=((1,), (0,))):
    """a @ b (or a^T b / a b^T through `contract`) with fp32 accumulation. dots: "bf16" (bf16 operands), "tf32"
    (fp32 operands, TF32 tensor-core products: 10 mantissa bits instead of 7; exact fp32 in interpret mode) or
    "ieee" (exact fp32)."""
    if dots == "bf16":
        a, b, precision = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
    else:
        precision = lax.Precision.HIGHEST if dots == "ieee" else lax.Precision.DEFAULT
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _coarse(dots: str) -> str:
    """The precision of the matmuls whose bf16 rounding barely moves the output (the solve's A and A X products and
    W S: each under 1e-6 relative RMS of the output alone, against 1-3e-3 for the others, CPU emulation at 4B head
    shapes: tools/gdn_precision.py, docs/accuracy.md): bf16 under "tf32", so only the sensitive products pay for TF32."""
    return "bf16" if dots == "tf32" else dots


def _operand_dtype(dots: str):
    """The dtype of the matmul operands the kernels store between passes (W, U, chunk states, V') or keep in
    registers (normalised q and k)."""
    return jnp.bfloat16 if dots == "bf16" else jnp.float32


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _unit_lower_inverses(lowers: list[jax.Array]) -> list[jax.Array]:
    """(I + L)^-1 for each strictly lower-triangular [SUB, SUB] L, by forward substitution one row at a time; the
    blocks are independent and advance together so that their steps overlap."""
    rows, cols = _iota((SUB, SUB), 0), _iota((SUB, SUB), 1)

    def substitute_row(i, inverses):
        updated = []
        for lower, inverse in zip(lowers, inverses, strict=True):
            coeffs = jnp.sum(jnp.where(rows == i, lower, 0.0), axis=0)  # L[i, :]
            row = jnp.sum(coeffs[:, None] * inverse, axis=0)  # L[i, :] @ inverse: only rows < i (final) contribute
            updated.append(inverse - jnp.where(rows == i, row[None, :], 0.0))
        return tuple(updated)

    identity = jnp.where(rows == cols, 1.0, 0.0)
    return list(lax.fori_loop(1, SUB, substitute_row, (identity,) * len(lowers)))


def _unit_lower_inverses_doubling(lowers: list[jax.Array]) -> list[jax.Array]:
    """The same inverses by repeated squaring: L is nilpotent (L^SUB = 0), so
    (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8): six [SUB, SUB] matmuls (exact fp32) per block instead of
    SUB - 1 dependent row steps, each a masked reduction across the tile. Rounding: <= 1.3e-5 of the largest
    inverse entry on near-duplicate keys against 7e-8 for the row steps (float64 check, 200 random blocks),
    both far below the bf16/TF32 operands the inverses multiply."""
    identity = jnp.where(_iota((SUB, SUB), 0) == _iota((SUB, SUB), 1), 1.0, 0.0)
    inverses = []
    for lower in lowers:
        power, inverse = lower, identity - lower
        for _ in range(3):  # L^2, L^4, L^8
            power = _dot(power, power, "ieee")
            inverse = _dot(inverse, identity + power, "ieee")
        inverses.append(inverse)
    return inverses


SOLVES = {"rows": _unit_lower_inverses, "doubling": _unit_lower_inverses_doubling}


def _load_sub_block(k_ref, v_ref, g_ref, beta_ref, a: int, start, length):
    """Tokens [a*SUB, (a+1)*SUB) of the chunk in fp32: k l2-normalised; padding tokens zeroed (g = 0: no decay)."""
    rows = pl.ds(a * SUB, SUB)
    valid = start + a * SUB + lax.iota(jnp.int32, SUB) < length  # [SUB]
    k = jnp.where(valid[:, None], l2norm(k_ref[rows, :].astype(jnp.float32)), 0.0)
    v = jnp.where(valid[:, None], v_ref[rows, :].astype(jnp.float32), 0.0)
    beta = jnp.where(valid, beta_ref[rows].astype(jnp.float32), 0.0)
    g = jnp.where(valid, g_ref[rows].astype(jnp.float32), 0.0)
    return k, v, beta, g


def _wy_prep_kernel(lengths_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, gamma_ref, *, dots: str, solve: str):
    """One chunk of one value head: k [C, dk], v [C, dv], g/beta [C] -> w [C, dk], u [C, dv], gamma [C].

    Solves (I + A) [W | U] = [beta exp(gamma) K | beta V] over row blocks a of SUB tokens:
        X_a = (I + A_aa)^-1 (R_a - sum_{b<a} A_ab X_b),   A_ab = (beta_a K_a) K_b^T * exp(gamma_a - gamma_b^T)
    """
    start = pl.program_id(2) * CHUNK
    length = lengths_ref[...]

    @pl.when(start < length)
    def _():
        blocks = [_load_sub_block(k_ref, v_ref, g_ref, beta_ref, a, start, length) for a in range(CHUNK // SUB)]
        keys = [k for k, _, _, _ in blocks]
        keys_beta = [k * beta[:, None] for k, _, beta, _ in blocks]
        gammas, offset = [], jnp.zeros((), jnp.float32)
        for _, _, _, g in blocks:
            gammas.append(jnp.cumsum(g) + offset)
            offset = offset + jnp.sum(g)

        strict = _iota((SUB, SUB), 0) > _iota((SUB, SUB), 1)
        diagonals = []
        for k, k_beta, gamma in zip(keys, keys_beta, gammas, strict=True):
            decay = jnp.exp(jnp.where(strict, gamma[:, None] - gamma[None, :], 0.0))
            diagonals.append(jnp.where(strict, _dot(k_beta, k, _coarse(dots), ((1,), (1,))) * decay, 0.0))
        inverses = SOLVES[solve](diagonals)

        w_blocks, u_blocks = [], []
        for a, (_, v, beta, _) in enumerate(blocks):
            rhs_w, rhs_u = keys_beta[a] * jnp.exp(gammas[a])[:, None], v * beta[:, None]
            for b in range(a):  # every token of block b precedes every token of block a
                decay = jnp.exp(gammas[a][:, None] - gammas[b][None, :])
                block = _dot(keys_beta[a], keys[b], _coarse(dots), ((1,), (1,))) * decay  # A_ab
                rhs_w = rhs_w - _dot(block, w_blocks[b], _coarse(dots))
                rhs_u = rhs_u - _dot(block, u_blocks[b], _coarse(dots))
            # Kept in the stored dtype: W's every later use is a matmul operand of that dtype anyway.
            w_blocks.append(_dot(inverses[a], rhs_w, dots).astype(w_ref.dtype))
            u_blocks.append(_dot(inverses[a], rhs_u, dots).astype(u_ref.dtype))
            rows = pl.ds(a * SUB, SUB)
            w_ref[rows, :] = w_blocks[a]
            u_ref[rows, :] = u_blocks[a]
            gamma_ref[rows] = gammas[a]


def _normalised_qk(q_ref, k_ref, rows, valid, scale: float, dtype):
    """The chunk's q/k rows [C, dk], l2-normalised, q scaled, k zeroed at padding tokens, in the matmul operand dtype
    (they are matmul operands only: bf16 halves their registers)."""
    q = (l2norm(q_ref[rows, :].astype(jnp.float32)) * scale).astype(dtype)
    return q, _normalised_k(k_ref, rows, valid, dtype)


def _normalised_k(k_ref, rows, valid, dtype):
    """The chunk's k rows [C, dk], l2-normalised and zeroed at padding tokens, in the matmul operand dtype."""
    return jnp.where(valid[:, None], l2norm(k_ref[rows, :].astype(jnp.float32)), 0.0).astype(dtype)


def _causal_mask():
    return _iota((CHUNK, CHUNK), 0) >= _iota((CHUNK, CHUNK), 1)


def _chunk_output(q, k, gamma, state, v_new, causal, dots: str):
    """O = (Q exp(gamma)) S + tril(Q K^T * Gamma) V' [C, bv] fp32, from the chunk's start state S [dk, bv]."""
    attn = _dot(q, k, dots, ((1,), (1,))) * jnp.exp(jnp.where(causal, gamma[:, None] - gamma[None, :], 0.0))
    attn = jnp.where(causal, attn, 0.0)
    return _dot(q.astype(jnp.float32) * jnp.exp(gamma)[:, None], state, dots) + _dot(attn, v_new, dots)


def _next_state(state, k, gamma, gamma_last, v_new, dots: str):
    """S <- exp(gamma_last) S + (K exp(gamma_last - gamma))^T V'."""
    k_decayed = k.astype(jnp.float32) * jnp.exp(gamma_last - gamma)[:, None]
    return state * jnp.exp(gamma_last) + _dot(k_decayed, v_new, dots, ((0,), (0,)))


def _state_pass_kernel(
    lengths_ref, q_ref, k_ref, w_ref, u_ref, gamma_ref, state_ref, o_ref, state_out_ref, *, dots: str, scale: float
):
    """One (row, value head, dv slice): q/k/w [T, dk], u [T, bv], gamma [T], state [dk, bv] -> o [T, bv], state."""
    length = lengths_ref[...]
    num_chunks = o_ref.shape[0] // CHUNK
    num_valid = (length + CHUNK - 1) // CHUNK
    causal = _causal_mask()

    def chunk_step(c, state):  # state [dk, bv] fp32
        start = pl.multiple_of(c * CHUNK, CHUNK)
        rows = pl.ds(start, CHUNK)
        valid = start + lax.iota(jnp.int32, CHUNK) < length  # [C]
        q, k = _normalised_qk(q_ref, k_ref, rows, valid, scale, u_ref.dtype)
        gamma = gamma_ref[rows]
        gamma_last = gamma_ref[start + CHUNK - 1]  # padding tokens carry g = 0, so this is the last valid gamma
        v_new = u_ref[rows, :].astype(jnp.float32) - _dot(w_ref[rows, :], state, _coarse(dots))  # [C, bv]
        out = _chunk_output(q, k, gamma, state, v_new, causal, dots)
        o_ref[rows, :] = jnp.where(valid[:, None], out, 0.0).astype(o_ref.dtype)
        return _next_state(state, k, gamma, gamma_last, v_new, dots)

    def zero_chunk(c, carry):  # outputs of padding-only chunks are defined as zeros
        o_ref[pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK), :] = jnp.zeros((CHUNK, o_ref.shape[1]), o_ref.dtype)
        return carry

    state_out_ref[...] = lax.fori_loop(0, num_valid, chunk_step, state_ref[...])
    lax.fori_loop(num_valid, num_chunks, zero_chunk, 0)


def _chunk_states_kernel(
    lengths_ref, k_ref, w_ref, u_ref, gamma_ref, state_ref, states_ref, v_new_ref, state_out_ref, *, dots: str
):
    """One (row, value head, dv slice), state only: k/w [T, dk], u [T, bv], gamma [T], state [dk, bv] -> each valid
    chunk's start state states [n, dk, bv] and V' [T, bv], and the final state. Chunks past the length are not
    written (the output pass reads neither their states nor their V')."""
    length = lengths_ref[...]
    num_valid = (length + CHUNK - 1) // CHUNK

    def chunk_step(c, state):  # state [dk, bv] fp32
        start = pl.multiple_of(c * CHUNK, CHUNK)
        rows = pl.ds(start, CHUNK)
        valid = start + lax.iota(jnp.int32, CHUNK) < length  # [C]
        # S_c, the chunk's start state, in the operand dtype: the output pass uses it only as a matmul operand
        # (dots="bf16": rounded to bf16 there anyway, so bf16 storage halves this traffic and changes nothing).
        states_ref[c] = state.astype(states_ref.dtype)
        k = _normalised_k(k_ref, rows, valid, u_ref.dtype)
        gamma = gamma_ref[rows]
        gamma_last = gamma_ref[start + CHUNK - 1]  # padding tokens carry g = 0, so this is the last valid gamma
        v_new = u_ref[rows, :].astype(jnp.float32) - _dot(w_ref[rows, :], state, _coarse(dots))  # [C, bv]
        # Stored in the operand dtype: the output pass uses V' only as a matmul operand, as the fused kernel does.
        v_new_ref[rows, :] = v_new.astype(v_new_ref.dtype)
        return _next_state(state, k, gamma, gamma_last, v_new, dots)

    state_out_ref[...] = lax.fori_loop(0, num_valid, chunk_step, state_ref[...])


def _chunk_output_kernel(lengths_ref, q_ref, k_ref, gamma_ref, state_ref, v_new_ref, o_ref, *, dots: str, scale: float):
    """One (row, value head, chunk, dv slice): q/k [C, dk], gamma [C], start state [dk, bv], V' [C, bv] -> o [C, bv].
    Chunks past the length are written as zeros without reading S_c or V'_c, which were never stored for them."""
    start = pl.program_id(2) * CHUNK
    length = lengths_ref[...]

    @pl.when(start < length)
    def _():
        valid = start + lax.iota(jnp.int32, CHUNK) < length  # [C]
        q, k = _normalised_qk(q_ref, k_ref, slice(None), valid, scale, v_new_ref.dtype)
        out = _chunk_output(q, k, gamma_ref[...], state_ref[...], v_new_ref[...], _causal_mask(), dots)
        o_ref[...] = jnp.where(valid[:, None], out, 0.0).astype(o_ref.dtype)

    @pl.when(start >= length)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _wy_prep(k, v, g, beta, lengths, dots: str, interpret: bool, num_warps: int, solve: str):
    """k [P, T, nk, dk], v [P, T, nv, dv], g/beta [P, T, nv] -> w [P, nv, T, dk], u [P, nv, T, dv], gamma [P, nv, T]."""
    num_rows, seq, num_heads, dv = v.shape
    dk = k.shape[-1]
    ratio = num_heads // k.shape[2]
    store = _operand_dtype(dots)  # U; W is only read by W S, a `_coarse` product
    return pl.pallas_call(
        functools.partial(_wy_prep_kernel, dots=dots, solve=solve),
        grid=(num_rows, num_heads, seq // CHUNK),
        in_specs=[
            pl.BlockSpec((None,), lambda p, h, c: (p,)),
            pl.BlockSpec((None, CHUNK, None, dk), lambda p, h, c: (p, c, h // ratio, 0)),
            pl.BlockSpec((None, CHUNK, None, dv), lambda p, h, c: (p, c, h, 0)),
            pl.BlockSpec((None, CHUNK, None), lambda p, h, c: (p, c, h)),
            pl.BlockSpec((None, CHUNK, None), lambda p, h, c: (p, c, h)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, CHUNK, dk), lambda p, h, c: (p, h, c, 0)),
            pl.BlockSpec((None, None, CHUNK, dv), lambda p, h, c: (p, h, c, 0)),
            pl.BlockSpec((None, None, CHUNK), lambda p, h, c: (p, h, c)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, num_heads, seq, dk), _operand_dtype(_coarse(dots))),
            jax.ShapeDtypeStruct((num_rows, num_heads, seq, dv), store),
            jax.ShapeDtypeStruct((num_rows, num_heads, seq), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),  # 8: 4 warps spill (ptxas, sm_90)
        interpret=interpret,
        name="gdn_prefill_wy_prep",
    )(lengths, k, v, g, beta)


def _walk_specs(seq: int, dk: int, block_v: int, ratio: int) -> tuple:
    """BlockSpecs of the sequential passes' grid (row, value head, dv slice): lengths; a key head's rows [T, dk]
    (q, k); w [T, dk]; u-shaped [T, block_v]; gamma [T]; the state slice [dk, block_v]."""
    return (
        pl.BlockSpec((None,), lambda p, h, j: (p,)),
        pl.BlockSpec((None, seq, None, dk), lambda p, h, j: (p, 0, h // ratio, 0)),
        pl.BlockSpec((None, None, seq, dk), lambda p, h, j: (p, h, 0, 0)),
        pl.BlockSpec((None, None, seq, block_v), lambda p, h, j: (p, h, 0, j)),
        pl.BlockSpec((None, None, seq), lambda p, h, j: (p, h, 0)),
        pl.BlockSpec((None, None, dk, block_v), lambda p, h, j: (p, h, 0, j)),
    )


def _walk(k, u, tiling: tuple[int, ...]) -> tuple:
    """What the two sequential passes share: their grid (row, value head, dv slice), `_walk_specs`, and the
    compiler params of tiling (block_v, num_warps, num_stages)."""
    num_rows, num_heads, seq, dv = u.shape
    block_v, num_warps, num_stages = tiling
    specs = _walk_specs(seq, k.shape[-1], block_v, num_heads // k.shape[2])
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return (num_rows, num_heads, dv // block_v), specs, params


def _state_pass(q, k, w, u, gamma, state, lengths, out_dtype, tiling: tuple[int, ...], dots: str, interpret: bool):
    """The sequential pass over chunks; returns o [P, T, nv, dv] and the new state [P, nv, dk, dv]."""
    num_rows, num_heads, seq, dv = u.shape
    grid, (lengths_spec, row_major, w_spec, u_spec, gamma_spec, state_spec), params = _walk(k, u, tiling)
    return pl.pallas_call(
        functools.partial(_state_pass_kernel, dots=dots, scale=q.shape[-1] ** -0.5),
        grid=grid,
        in_specs=[lengths_spec, row_major, row_major, w_spec, u_spec, gamma_spec, state_spec],
        out_specs=[pl.BlockSpec((None, seq, None, tiling[0]), lambda p, h, j: (p, 0, h, j)), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, seq, num_heads, dv), out_dtype),
            jax.ShapeDtypeStruct(state.shape, jnp.float32),
        ],
        input_output_aliases={6: 1},
        compiler_params=params,
        interpret=interpret,
        name="gdn_prefill_state_pass",
    )(lengths, q, k, w, u, gamma, state)


def _chunk_states(k, w, u, gamma, state, lengths, tiling: tuple[int, ...], dots: str, interpret: bool):
    """The sequential pass, state only; returns each chunk's start state [P, nv, n, dk, dv] and V' [P, nv, T, dv]
    (both in u's dtype: the matmul operand dtype) and the new state [P, nv, dk, dv] (fp32)."""
    num_rows, num_heads, seq, dv = u.shape
    dk = k.shape[-1]
    grid, (lengths_spec, row_major, w_spec, u_spec, gamma_spec, state_spec), params = _walk(k, u, tiling)
    return pl.pallas_call(
        functools.partial(_chunk_states_kernel, dots=dots),
        grid=grid,
        in_specs=[lengths_spec, row_major, w_spec, u_spec, gamma_spec, state_spec],
        out_specs=[
            pl.BlockSpec((None, None, seq // CHUNK, dk, tiling[0]), lambda p, h, j: (p, h, 0, 0, j)),
            u_spec,  # V', laid out as u
            state_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, num_heads, seq // CHUNK, dk, dv), u.dtype),
            jax.ShapeDtypeStruct(u.shape, u.dtype),
            jax.ShapeDtypeStruct(state.shape, jnp.float32),
        ],
        input_output_aliases={5: 2},
        compiler_params=params,
        interpret=interpret,
        name="gdn_prefill_chunk_states",
    )(lengths, k, w, u, gamma, state)


# Output pass tile: a 64-wide dv slice in 4 warps compiles to 168 registers and no spills at dk = 128 (bf16, sm_90:
# ptxas of CUDA 13.4 through pip Triton 3.9, a proxy for XLA's Triton); 128 wide spills in 4 warps, takes 217 in 8.
OUTPUT_BLOCK_V = 64
OUTPUT_NUM_WARPS = 4


def _chunk_outputs(q, k, gamma, states, v_new, lengths, out_dtype, dots: str, interpret: bool,
                   num_warps: int = OUTPUT_NUM_WARPS, block_v: int = OUTPUT_BLOCK_V):  # fmt: skip
    """The parallel output pass: one program per (row, value head, chunk, dv slice); returns o [P, T, nv, dv]."""
    num_rows, num_heads, seq, dv = v_new.shape
    dk = q.shape[-1]
    ratio = num_heads // q.shape[2]
    block_v = min(block_v, dv)
    chunk_rows = pl.BlockSpec((None, CHUNK, None, dk), lambda p, h, c, j: (p, c, h // ratio, 0))
    return pl.pallas_call(
        functools.partial(_chunk_output_kernel, dots=dots, scale=dk**-0.5),
        grid=(num_rows, num_heads, seq // CHUNK, dv // block_v),
        in_specs=[
            pl.BlockSpec((None,), lambda p, h, c, j: (p,)),
            chunk_rows,
            chunk_rows,
            pl.BlockSpec((None, None, CHUNK), lambda p, h, c, j: (p, h, c)),
            pl.BlockSpec((None, None, None, dk, block_v), lambda p, h, c, j: (p, h, c, 0, j)),
            pl.BlockSpec((None, None, CHUNK, block_v), lambda p, h, c, j: (p, h, c, j)),
        ],
        out_specs=pl.BlockSpec((None, CHUNK, None, block_v), lambda p, h, c, j: (p, c, h, j)),
        out_shape=jax.ShapeDtypeStruct((num_rows, seq, num_heads, dv), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="gdn_prefill_chunk_output",
    )(lengths, q, k, gamma, states, v_new)


def _default_block_v(num_rows: int, num_heads: int, dv: int) -> int:
    """Slices of dv per (row, head) in the sequential pass: 64 wide, or 32 when that leaves fewer than ~2 programs per
    SM of an H200 (132 SMs) — the pass is latency-bound, so more independent programs beat less recomputed Q K^T."""
    block_v = min(64, dv)
    if num_rows * num_heads * (dv // block_v) < 264 and dv >= 32:
        block_v = 32
    return block_v


OUTPUT_PASSES = ("fused", "parallel")


def _default_num_warps(block_v: int, output_pass: str) -> int:
    """Warps per program of the sequential pass: the fewest spills at dk = 128 (ptxas, sm_90). The state-only pass of
    "parallel" holds less (no Q, Q K^T or O): in 8 warps 146 registers at 32 wide, 222 at 64 (4 warps spill at 64)."""
    return 8 if block_v <= 32 or output_pass == "parallel" else 4


def gdn_chunked_prefill_pallas(
    q,
    k,
    v,
    g,
    beta,
    state,
    lengths,
    *,
    interpret=False,
    block_v=None,
    num_warps=None,
    num_stages=None,
    output_pass="parallel",
    prep_warps=None,
    output_warps=None,
    output_block_v=None,
    dots=None,
    solve=None,
):
    """Pallas form of `gdn_chunked_prefill_ref`: same layouts, math and result dtypes.

    output_pass: "fused" computes the output inside the sequential pass (two pallas_calls); "parallel" has the
    sequential pass store each chunk's start state and V' and computes the output in a third, fully parallel
    pallas_call (n_chunks * dk * dv states per row and value head in between, in the operand dtype). "parallel" is
    the default: 0.187 / 0.351 / 0.656 ms against "fused" 0.218 / 0.406 / 0.791 ms at 1k / 2k / 4k tokens, 4B heads,
    one row, bf16, on the H200 (`tools/bench_gdn_prefill.py --output-pass fused parallel`, docs/kernels.md).
    block_v / num_warps / num_stages tile the sequential pass (dv slice per program, warps per program, Triton's
    software-pipelining depth of its chunk loop); None picks defaults (num_stages 2). prep_warps / output_warps: warps of
    the WY kernel (default DEFAULT_PREP_WARPS) and of the parallel output kernel (default OUTPUT_NUM_WARPS), for tuning sweeps; fla
    autotunes warps and stages of every one of its kernels per shape, these are fixed until measured.
    output_block_v: the output kernel's dv slice (default OUTPUT_BLOCK_V). A slice as wide as dv reads q and k and
    computes Q K^T once per (chunk, head) instead of once per slice, at fewer, larger programs (not measured yet:
    the A/B is `tools/bench_gdn_prefill.py --output-block-v 64 128 --output-warps 4 8`).
    dots: the matmul operand precision for bf16 inputs (fp32 inputs always take "ieee"): "bf16" rounds every operand
    (W, U, chunk states, V', normalised q/k) to bf16, as flash-linear-attention does; "tf32" keeps them fp32 (W and
    the products `_coarse` names excepted) and multiplies in TF32, for an output error about 8x smaller against the
    fp32 reference (CPU emulation at 4B head shapes, tools/gdn_precision.py) at the cost of fp32 traffic between
    passes. None: DEFAULT_DOTS.
    solve: how the WY kernel inverts its 16 x 16 diagonal blocks, "rows" (forward substitution one row at a time,
    each step a masked cross-tile reduction) or "doubling" (repeated squaring, six small exact-fp32 matmuls).
    None: DEFAULT_SOLVE for bf16 inputs, "rows" for fp32 inputs.

    The output at padding tokens (index >= length) is zero (the ref leaves S^T q there); callers must not read it.
    dk and dv must be powers of two >= 16 (Triton tiles); T any length (padded to a multiple of 64 inside).
    """
    if output_pass not in OUTPUT_PASSES:
        raise ValueError(f"output_pass={output_pass!r}: one of {OUTPUT_PASSES}")
    num_rows, seq, num_heads, dv = v.shape
    dk = q.shape[-1]
    assert k.shape == q.shape and num_heads % q.shape[2] == 0, (q.shape, k.shape, v.shape)
    assert all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv)), f"dk={dk}, dv={dv}: powers of two >= 16"
    dots = "ieee" if q.dtype == jnp.float32 else (dots or DEFAULT_DOTS)
    if dots not in DOTS:
        raise ValueError(f"dots={dots!r}: one of {DOTS}")
    # fp32 inputs keep the row solve: on near-duplicate keys the squaring's rounding reaches ~2e-5 of the state
    # (tests/test_kernels_gdn_prefill.py), 50x the row solve's, which the fp32 (accuracy) path does not need to
    # give up; next to bf16 operand rounding (2^-9) it is nothing.
    solve = solve or ("rows" if dots == "ieee" else DEFAULT_SOLVE)
    if solve not in SOLVES:
        raise ValueError(f"solve={solve!r}: one of {tuple(SOLVES)}")
    block_v = block_v or _default_block_v(num_rows, num_heads, dv)
    tiling = (block_v, num_warps or _default_num_warps(block_v, output_pass), num_stages or 2)
    # lax primitives only around the pallas_calls: the stream regions of DESIGN section 6 refuse nested jits
    # (jnp.pad, jnp.clip are jitted).
    padded = seq + (-seq) % CHUNK
    q, k, v, g, beta = (pad_to(x, (x.shape[0], padded, *x.shape[2:])) for x in (q, k, v, g, beta))
    lengths = lax.clamp(0, lengths.astype(jnp.int32), seq)
    w, u, gamma = _wy_prep(
        k, v, g.astype(jnp.float32), beta, lengths, dots, interpret, prep_warps or DEFAULT_PREP_WARPS, solve
    )
    state = state.astype(jnp.float32)
    if output_pass == "fused":
        out, state = _state_pass(q, k, w, u, gamma, state, lengths, v.dtype, tiling, dots, interpret)
    else:
        states, v_new, state = _chunk_states(k, w, u, gamma, state, lengths, tiling, dots, interpret)
        out = _chunk_outputs(q, k, gamma, states, v_new, lengths, v.dtype, dots, interpret,
                             output_warps or OUTPUT_NUM_WARPS, output_block_v or OUTPUT_BLOCK_V)  # fmt: skip
    return out[:, :seq], state
