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

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from qwen35_jax.kernels.decode_attention import pad_to

CHUNK = 64
EPS = 1e-6  # the l2norm's, as HF's Qwen3.5 takes it


def l2norm(x: jax.Array, eps: float = EPS) -> jax.Array:
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
# The WY decomposition of the chunked form above, in three pallas_calls, as flash-linear-attention splits it: only the
# state walk is sequential, everything else runs one program per chunk.
#   1. `_wy_prep_kernel`, grid (P, nv, chunks): per chunk and value head it l2-normalises k, masks the padding tokens,
#      takes the cumulative gates gamma and solves (I + A) [W | U] = [beta exp(gamma) K | beta V] by blocked forward
#      substitution over four 16-row blocks (each diagonal block inverted on its own, the blocks below it updated with
#      small matmuls), so neither A nor its inverse ever leaves registers.
#   2. `_chunk_states_kernel`, grid (P, nv, dv / block_v): walks the row's valid chunks in order, carrying its fp32
#      state slice S [dk, block_v] in registers; per chunk it stores the raw queries against the chunk's start state,
#      Q_c S_c, and V'_c = U - W S_c (both laid out as u), then steps the state. Q_c S_c is off the recurrence's chain,
#      and its [C, bv] is half the bytes of storing S_c [dk, bv] for the output pass to multiply (H100, 8k tokens: the
#      output pass 0.357 -> 0.229 ms, the walk 0.314 -> 0.331 ms with Q S a bf16 product, the call 1.025 -> 0.90 ms).
#      Chunks past a row's length are skipped and their Q_c S_c and V'_c are left unwritten.
#   3. `_chunk_output_kernel`, grid (P, nv, n_chunks, dv / output_block_v): O_c = diag(exp(gamma) / |q|) Q_c S_c +
#      causal(Q_c K_c^T Gamma) V'_c for one chunk and dv slice; chunks past a row's length are written as zeros
#      without reading Q_c S_c or V'_c. Moving the output out of the walk takes Q K^T out of the sequential loop
#      (where every dv slice recomputed it): 0.187 / 0.351 / 0.656 ms against 0.218 / 0.406 / 0.791 ms with the output
#      inside the walk at 1k / 2k / 4k tokens (H200, 4B heads, one row, bf16).
# No jnp glue runs over the activations: l2norm, the query scale and the key-head -> value-head repeat (a BlockSpec
# index map) happen inside the kernels, and the packed form reads q, k and v out of the conv's one output (each
# BlockSpec picks its heads); the only glue is a pad of the token axis up to a multiple of 64 when T is not one.
# Precision depends on the input dtype (fp32 accumulation throughout; gates, decays, norms and the state stay fp32):
# - bf16 inputs ("tf32"): matmul operands stay fp32 and multiply in TF32, except the products whose rounding barely
#   moves the output (`_coarse`: bf16) and those of the raw bf16 keys, which are exact in bf16: Q K^T (bf16 q and k)
#   and the state update (the keys with V' split into bf16 high and low parts, `_next_state`); the diagonal blocks
#   are inverted by repeated squaring (exact fp32 matmuls).
#   With every operand in bf16 the 4B golden gate fails on the H200 (docs/accuracy.md).
# - fp32 inputs ("ieee"): every product in exact fp32, and the diagonal blocks inverted row by row, whose rounding on
#   near-duplicate keys is 50x smaller than the squaring's (~2e-5 of the state, the fp32 tests' whole tolerance).
# ---------------------------------------------------------------------------------------------------------------------

SUB = 16  # rows per diagonal block of the intra-chunk triangular solve


@dataclasses.dataclass(frozen=True)
class GdnPrefillTuning:
    """Tiles of the three pallas_calls. block_v / num_warps / num_stages: the chunk-state walk's dv slice per program,
    warps per program and Triton's software-pipelining depth of its chunk loop; prep_warps: the WY kernel's warps;
    output_block_v / output_warps: the output kernel's dv slice and warps; output_block_k / output_stages: the dk
    slice and pipelining depth of its product loop."""

    block_v: int = 64
    num_warps: int = 8  # the 64-wide state walk: 4 warps spill
    num_stages: int = 2
    prep_warps: int = 4  # with the squaring solve: 0.044 / 0.296 ms at 1k / 8k tokens (H200, 4B heads)
    # A head's whole dv in one program: Q K^T once a chunk instead of once a slice. Its products loop over dk in
    # slices of output_block_k, pipelined output_stages deep: 32 / 3 stages / 4 warps took 0.355 ms at 8k tokens,
    # 64 / 2 / 4 0.372 ms, 128 / 2 / 8 (no loop) 0.501 ms (H200, 4B heads, tools/bench_gdn_prefill.py).
    output_block_v: int = 128
    output_warps: int = 4
    output_block_k: int = 32
    output_stages: int = 3


def gdn_prefill_tuning(num_rows: int, num_heads: int, dv: int) -> GdnPrefillTuning:
    """The measured tiles for a call of num_rows x num_heads (value heads): the walk's slice is 64 wide, or 32 when
    that leaves fewer than ~2 programs per SM of an H200 (132 SMs) — the walk is latency-bound, so more independent
    programs beat fewer, wider ones. The 32-wide walk pipelines its chunk loop three deep in 4 warps (the walk alone:
    0.316 ms at 8k tokens against 0.328 in 8 warps and 0.390 two deep, one row at 4B heads on the H200); the 64-wide
    one is slower so."""
    if num_rows * num_heads * (dv // min(64, dv)) < 264 and dv >= 32:
        return GdnPrefillTuning(block_v=32, num_warps=4, num_stages=3)
    return GdnPrefillTuning(block_v=min(64, dv))


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
    """The precision of the matmuls whose bf16 rounding barely moves the output: the solve's A and A X products, W S
    and Q S. Each alone in bf16 takes the output's relative RMS error from 0.0347% to 0.0347% (Q S: 0.0356%), where
    the solve's W, U product or A V' in bf16 take it to 0.167% or 0.237% (CPU emulation at 4B head shapes, 512
    tokens: tools/gdn_precision.py --cases sites, docs/accuracy.md). bf16 under "tf32", so only the sensitive
    products pay for TF32."""
    return "bf16" if dots == "tf32" else dots


def _operand_dtype(dots: str):
    """The dtype a matmul operand of precision `dots` is stored in between passes (W: `_coarse`)."""
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


def _load_sub_block(k_ref, v_ref, g_ref, beta_ref, a: int, start, length):
    """Tokens [a*SUB, (a+1)*SUB) of the chunk in fp32: k l2-normalised; padding tokens zeroed (g = 0: no decay)."""
    rows = pl.ds(a * SUB, SUB)
    valid = start + a * SUB + lax.iota(jnp.int32, SUB) < length  # [SUB]
    k = jnp.where(valid[:, None], l2norm(k_ref[rows, :].astype(jnp.float32)), 0.0)
    v = jnp.where(valid[:, None], v_ref[rows, :].astype(jnp.float32), 0.0)
    beta = jnp.where(valid, beta_ref[rows].astype(jnp.float32), 0.0)
    g = jnp.where(valid, g_ref[rows].astype(jnp.float32), 0.0)
    return k, v, beta, g


def _wy_prep_kernel(lengths_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, gamma_ref, *, dots: str):
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
        inverses = (_unit_lower_inverses if dots == "ieee" else _unit_lower_inverses_doubling)(diagonals)

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


def _causal_mask():
    return _iota((CHUNK, CHUNK), 0) >= _iota((CHUNK, CHUNK), 1)


def _next_state(state, k, key_scale, gamma_last, v_new, dots: str):
    """S <- exp(gamma_last) S + K^^T diag(key_scale) V', K^^T the normalised, decayed keys: k [C, dk] the raw keys (zero
    at padding tokens), key_scale [C] fp32 their 1 / |k| exp(gamma_last - gamma) (zero at padding tokens).

    The scales go to V' (a [C, bv] tile) instead of the keys ([C, dk]). On bf16 keys ("tf32") the product then has bf16
    keys, which are exact, and splits the scaled V' into bf16 high and low parts: two bf16 products, 16 bits of V' where
    one TF32 product of the normalised fp32 keys kept 10 bits of each operand."""
    scaled = v_new * key_scale[:, None]
    if dots == "tf32" and k.dtype == jnp.bfloat16:
        high = scaled.astype(jnp.bfloat16)
        low = scaled - high.astype(jnp.float32)
        update = _dot(k, high, "bf16", ((0,), (0,))) + _dot(k, low, "bf16", ((0,), (0,)))
    else:
        update = _dot(k, scaled, dots, ((0,), (0,)))
    return state * jnp.exp(gamma_last) + update


def _chunk_states_kernel(
    lengths_ref, q_ref, k_ref, w_ref, u_ref, gamma_ref, state_ref, q_state_ref, v_new_ref, state_out_ref, *, dots: str
):
    """One (row, value head, dv slice): q/k/w [T, dk], u [T, bv], gamma [T], state [dk, bv] -> Q_c S_c [T, bv] (the raw
    queries against each chunk's start state), V' [T, bv], and the final state. Chunks past the length are not
    written (the output pass reads neither their Q S nor their V')."""
    length = lengths_ref[...]
    num_valid = (length + CHUNK - 1) // CHUNK

    def chunk_step(c, state):  # state [dk, bv] fp32
        start = pl.multiple_of(c * CHUNK, CHUNK)
        rows = pl.ds(start, CHUNK)
        valid = start + lax.iota(jnp.int32, CHUNK) < length  # [C]
        # Q_c S_c off the recurrence's chain: the output pass scales its rows by the norms and decays. The raw bf16
        # queries against the state rounded as W S rounds it (`_coarse`): one bf16 product instead of a TF32 one.
        q_state_ref[rows, :] = _dot(q_ref[rows, :], state, _coarse(dots)).astype(q_state_ref.dtype)
        k = jnp.where(valid[:, None], k_ref[rows, :], jnp.zeros((), k_ref.dtype))  # raw: `_next_state` scales V'
        gamma = gamma_ref[rows]
        gamma_last = gamma_ref[start + CHUNK - 1]  # padding tokens carry g = 0, so this is the last valid gamma
        k32 = k.astype(jnp.float32)
        key_scale = jnp.where(valid, lax.rsqrt(jnp.sum(k32 * k32, axis=1) + EPS) * jnp.exp(gamma_last - gamma), 0.0)
        v_new = u_ref[rows, :].astype(jnp.float32) - _dot(w_ref[rows, :], state, _coarse(dots))  # [C, bv]
        v_new_ref[rows, :] = v_new.astype(v_new_ref.dtype)
        return _next_state(state, k, key_scale, gamma_last, v_new, dots)

    state_out_ref[...] = lax.fori_loop(0, num_valid, chunk_step, state_ref[...])


def _chunk_output_kernel(lengths_ref, q_ref, k_ref, gamma_ref, q_state_ref, v_new_ref, o_ref, *, dots: str,
                         scale: float, block_k: int):  # fmt: skip
    """One (row, value head, chunk, dv slice): q/k [C, dk], gamma [C], Q S_c [C, bv] (the walk's), V' [C, bv] ->
    o [C, bv]. Chunks past the length are written as zeros without reading Q S_c or V'_c, never stored for them.

    Q K^T runs on the raw q and k in slices of block_k, so that Triton pipelines their loads under the product; the l2
    norms are row scales applied after: Q^ K^^T = diag(1/|q|) Q K^T diag(1/|k|) and Q^ S = diag(1/|q|) Q S. bf16 q
    and k then multiply exactly (bf16 products, fp32 sums)."""
    start = pl.program_id(2) * CHUNK
    length = lengths_ref[...]

    @pl.when(start < length)
    def _():
        valid = start + lax.iota(jnp.int32, CHUNK) < length  # [C]
        raw = "bf16" if q_ref.dtype == jnp.bfloat16 and dots != "ieee" else dots  # bf16 q k^T: exact products

        def accumulate(i, sums):
            qk, q_squares, k_squares = sums
            cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            q, k = q_ref[:, cols], k_ref[:, cols]
            q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
            qk = qk + _dot(q, k, raw, ((1,), (1,)))
            return qk, q_squares + jnp.sum(q32 * q32, axis=1), k_squares + jnp.sum(k32 * k32, axis=1)

        zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
        sums = (zeros((CHUNK, CHUNK)), zeros((CHUNK,)), zeros((CHUNK,)))
        qk, q_squares, k_squares = lax.fori_loop(0, q_ref.shape[-1] // block_k, accumulate, sums)
        q_scale = lax.rsqrt(q_squares + EPS) * scale  # l2norm's x * rsqrt(sum x^2 + eps), then the query scale
        k_scale = jnp.where(valid, lax.rsqrt(k_squares + EPS), 0.0)  # padding keys: zero
        gamma, causal = gamma_ref[...], _causal_mask()
        decay = jnp.exp(jnp.where(causal, gamma[:, None] - gamma[None, :], 0.0))
        attn = jnp.where(causal, qk * q_scale[:, None] * k_scale[None, :] * decay, 0.0)
        out = q_state_ref[...] * (q_scale * jnp.exp(gamma))[:, None] + _dot(attn, v_new_ref[...], dots)
        o_ref[...] = jnp.where(valid[:, None], out, 0.0).astype(o_ref.dtype)

    @pl.when(start >= length)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Heads:
    """Where the kernels read q, k and v: arrays [P, T, heads, d] (three, or one packed array three times) and the
    head each starts at, so a BlockSpec picks value head h's heads without a copy: q's and k's at head
    first + h // ratio, v's at v_first + h."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_first: int
    k_first: int
    v_first: int
    key_heads: int

    @property
    def seq(self) -> int:
        return self.q.shape[1]


def _wy_prep(heads: _Heads, g, beta, lengths, dots: str, interpret: bool, num_warps: int):
    """k, v (`heads`), g/beta [P, T, nv] -> w [P, nv, T, dk], u [P, nv, T, dv], gamma [P, nv, T]."""
    num_rows, seq, num_heads = g.shape
    dk, dv = heads.k.shape[-1], heads.v.shape[-1]
    ratio, k0, v0 = num_heads // heads.key_heads, heads.k_first, heads.v_first
    return pl.pallas_call(
        functools.partial(_wy_prep_kernel, dots=dots),
        grid=(num_rows, num_heads, seq // CHUNK),
        in_specs=[
            pl.BlockSpec((None,), lambda p, h, c: (p,)),
            pl.BlockSpec((None, CHUNK, None, dk), lambda p, h, c: (p, c, k0 + h // ratio, 0)),
            pl.BlockSpec((None, CHUNK, None, dv), lambda p, h, c: (p, c, v0 + h, 0)),
            pl.BlockSpec((None, CHUNK, None), lambda p, h, c: (p, c, h)),
            pl.BlockSpec((None, CHUNK, None), lambda p, h, c: (p, c, h)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, CHUNK, dk), lambda p, h, c: (p, h, c, 0)),
            pl.BlockSpec((None, None, CHUNK, dv), lambda p, h, c: (p, h, c, 0)),
            pl.BlockSpec((None, None, CHUNK), lambda p, h, c: (p, h, c)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, num_heads, seq, dk), _operand_dtype(_coarse(dots))),  # W: read by W S only
            jax.ShapeDtypeStruct((num_rows, num_heads, seq, dv), _operand_dtype(dots)),
            jax.ShapeDtypeStruct((num_rows, num_heads, seq), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="gdn_prefill_wy_prep",
    )(lengths, heads.k, heads.v, g, beta)


def _chunk_states(heads: _Heads, w, u, gamma, state, lengths, tuning: GdnPrefillTuning, dots: str, interpret: bool):
    """The sequential pass; returns Q_c S_c [P, nv, T, dv] (the raw queries against each chunk's start state) and V'
    [P, nv, T, dv] (both in u's dtype) and the new state [P, nv, dk, dv] (fp32)."""
    num_rows, num_heads, seq, dv = u.shape
    dk = heads.k.shape[-1]
    ratio, q0, k0 = num_heads // heads.key_heads, heads.q_first, heads.k_first
    block_v = min(tuning.block_v, dv)
    u_spec = pl.BlockSpec((None, None, seq, block_v), lambda p, h, j: (p, h, 0, j))
    state_spec = pl.BlockSpec((None, None, dk, block_v), lambda p, h, j: (p, h, 0, j))
    return pl.pallas_call(
        functools.partial(_chunk_states_kernel, dots=dots),
        grid=(num_rows, num_heads, dv // block_v),
        in_specs=[
            pl.BlockSpec((None,), lambda p, h, j: (p,)),
            pl.BlockSpec((None, seq, None, dk), lambda p, h, j: (p, 0, q0 + h // ratio, 0)),  # q: the key head's rows
            pl.BlockSpec((None, seq, None, dk), lambda p, h, j: (p, 0, k0 + h // ratio, 0)),  # k: the key head's rows
            pl.BlockSpec((None, None, seq, dk), lambda p, h, j: (p, h, 0, 0)),  # w
            u_spec,
            pl.BlockSpec((None, None, seq), lambda p, h, j: (p, h, 0)),  # gamma
            state_spec,
        ],
        out_specs=[u_spec, u_spec, state_spec],  # Q S and V', laid out as u
        out_shape=[
            jax.ShapeDtypeStruct(u.shape, u.dtype),
            jax.ShapeDtypeStruct(u.shape, u.dtype),
            jax.ShapeDtypeStruct(state.shape, jnp.float32),
        ],
        input_output_aliases={6: 2},
        compiler_params=plt.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="gdn_prefill_chunk_states",
    )(lengths, heads.q, heads.k, w, u, gamma, state)


def _chunk_outputs(heads: _Heads, gamma, q_states, v_new, lengths, out_dtype, tuning: GdnPrefillTuning, dots: str,
                   interpret: bool):  # fmt: skip
    """The parallel output pass: one program per (row, value head, chunk, dv slice); returns o [P, T, nv, dv]."""
    num_rows, num_heads, seq, dv = v_new.shape
    dk = heads.q.shape[-1]
    ratio, q0, k0 = num_heads // heads.key_heads, heads.q_first, heads.k_first
    block_v = min(tuning.output_block_v, dv)
    return pl.pallas_call(
        functools.partial(_chunk_output_kernel, dots=dots, scale=dk**-0.5, block_k=min(tuning.output_block_k, dk)),
        grid=(num_rows, num_heads, seq // CHUNK, dv // block_v),
        in_specs=[
            pl.BlockSpec((None,), lambda p, h, c, j: (p,)),
            pl.BlockSpec((None, CHUNK, None, dk), lambda p, h, c, j: (p, c, q0 + h // ratio, 0)),
            pl.BlockSpec((None, CHUNK, None, dk), lambda p, h, c, j: (p, c, k0 + h // ratio, 0)),
            pl.BlockSpec((None, None, CHUNK), lambda p, h, c, j: (p, h, c)),
            pl.BlockSpec((None, None, CHUNK, block_v), lambda p, h, c, j: (p, h, c, j)),  # Q S
            pl.BlockSpec((None, None, CHUNK, block_v), lambda p, h, c, j: (p, h, c, j)),  # V'
        ],
        out_specs=pl.BlockSpec((None, CHUNK, None, block_v), lambda p, h, c, j: (p, c, h, j)),
        out_shape=jax.ShapeDtypeStruct((num_rows, seq, num_heads, dv), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=tuning.output_warps, num_stages=tuning.output_stages),
        interpret=interpret,
        name="gdn_prefill_chunk_output",
    )(lengths, heads.q, heads.k, gamma, q_states, v_new)


def gdn_chunked_prefill_pallas(q, k, v, g, beta, state, lengths, *, interpret=False,
                               tuning: GdnPrefillTuning | None = None):  # fmt: skip
    """Pallas form of `gdn_chunked_prefill_ref`: same layouts, math and result dtypes. Three pallas_calls (the notes
    above): the WY factors and the output run one program per chunk, only the state walk is sequential.

    tuning: the tiles of the three pallas_calls; None takes `gdn_prefill_tuning` for the call's rows and heads.
    The output at padding tokens (index >= length) is zero (the ref leaves S^T q there); callers must not read it.
    dk and dv must be powers of two >= 16 (Triton tiles); T any length (padded to a multiple of 64 inside).
    """
    assert k.shape == q.shape and v.shape[2] % q.shape[2] == 0, (q.shape, k.shape, v.shape)
    q, k, v = (_pad_tokens(x) for x in (q, k, v))
    heads = _Heads(q, k, v, 0, 0, 0, key_heads=q.shape[2])
    return _prefill_calls(heads, g, beta, state, lengths, q.dtype, interpret, tuning)


def gdn_chunked_prefill_packed_ref(qkv, g, beta, state, lengths):
    """`gdn_chunked_prefill_ref` on the conv's packed output qkv [P, T, 2 nk dk + nv dv] (q, k, v side by side, the
    checkpoint's in_proj_qkv order), the head geometry read from state [P, nv, dk, dv]."""
    return gdn_chunked_prefill_ref(*split_packed_heads(qkv, *state.shape[1:]), g, beta, state, lengths)


def gdn_chunked_prefill_packed_pallas(qkv, g, beta, state, lengths, *, interpret=False,
                                      tuning: GdnPrefillTuning | None = None):  # fmt: skip
    """`gdn_chunked_prefill_pallas` reading q, k and v where the conv wrote them: qkv viewed as [P, T, heads, d]
    rows of d = dk = dv (a bitcast), each kernel's BlockSpecs pick their heads from it. Slicing them apart first
    cost three copy kernels a GDN layer (13 us of a 4B layer's ~400 at 1024 tokens on the H200). Head dims that
    differ take the slices."""
    num_value_heads, dk, dv = state.shape[1:]
    if dk != dv:
        return gdn_chunked_prefill_pallas(*split_packed_heads(qkv, num_value_heads, dk, dv), g, beta, state, lengths,
                                          interpret=interpret, tuning=tuning)  # fmt: skip
    key_heads = (qkv.shape[-1] - num_value_heads * dv) // (2 * dk)
    rows = _pad_tokens(qkv.reshape(*qkv.shape[:2], -1, dk))
    heads = _Heads(rows, rows, rows, 0, key_heads, 2 * key_heads, key_heads=key_heads)
    return _prefill_calls(heads, g, beta, state, lengths, qkv.dtype, interpret, tuning)


def split_packed_heads(qkv, num_value_heads: int, dk: int, dv: int):
    """q [P, T, nk, dk], k [P, T, nk, dk], v [P, T, nv, dv] of the packed qkv [P, T, 2 nk dk + nv dv]."""
    key_dim = (qkv.shape[-1] - num_value_heads * dv) // 2
    lead = qkv.shape[:-1]
    q, k, v = jnp.split(qkv, (key_dim, 2 * key_dim), axis=-1)
    return (q.reshape(*lead, key_dim // dk, dk), k.reshape(*lead, key_dim // dk, dk),
            v.reshape(*lead, num_value_heads, dv))  # fmt: skip


def _pad_tokens(x):
    """x [P, T, ...] with T padded to a multiple of CHUNK (the engine's chunk buckets are powers of two >= 16, so
    only T = 16 or 32 pads, a few KiB)."""
    return pad_to(x, (x.shape[0], x.shape[1] + (-x.shape[1]) % CHUNK, *x.shape[2:]))


def _prefill_calls(heads: _Heads, g, beta, state, lengths, out_dtype, interpret, tuning):
    num_rows, seq, num_heads = g.shape
    dk, dv = state.shape[-2:]
    assert all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv)), f"dk={dk}, dv={dv}: powers of two >= 16"
    tuning = tuning or gdn_prefill_tuning(num_rows, num_heads, dv)
    dots = "ieee" if out_dtype == jnp.float32 else "tf32"
    g, beta = (_pad_tokens(x) for x in (g, beta))
    lengths = lax.clamp(0, lengths.astype(jnp.int32), seq)
    w, u, gamma = _wy_prep(heads, g.astype(jnp.float32), beta, lengths, dots, interpret, tuning.prep_warps)
    q_states, v_new, state = _chunk_states(heads, w, u, gamma, state.astype(jnp.float32), lengths, tuning, dots,
                                         interpret)  # fmt: skip
    out = _chunk_outputs(heads, gamma, q_states, v_new, lengths, out_dtype, tuning, dots, interpret)
    return out[:, :seq], state
