"""Paged attention kernels: the Pallas decode and prefill kernels against their pure-JAX references, in interpret
mode on the CPU and compiled on the GPU (`-m gpu`, 4B shapes).

Caches are random normal K/V in pools of several layers (the call reads a traced `layer`, not layer 0); each
row owns distinct random pages, unused page-table entries point at the trash page 0, and padding rows are
what the runner sends (page table all 0; length 1 for decode, 0 for prefill).

Tolerances:
- fp32: both sides compute fp32 scores, an fp32 softmax and an fp32 value product (IEEE dots, no TF32); the
  kernel's online softmax only reorders the sums and rescales by exp(m_old - m_new): measured <= 2e-6 on
  outputs up to ~4 (a few fp32 ulps). atol = rtol = 1e-5 keeps 5x headroom, while any real mistake is far
  larger: one key too many or too few among <= 120 moves an output by |v_j - o| / n, about 1e-2, and a
  wrong layer, page or head by O(1).
- bf16: the reference rounds the normalised probabilities p / l to bf16, the kernel rounds exp(s - m)
  before dividing by l; both are one 2^-9 relative rounding per probability, and the outputs are then
  rounded to bf16 (one ulp is 2^-8 relative). Measured: at most one bf16 ulp apart. atol = rtol = 2^-7
  allows two to three ulps at |o| ~ 1; a one-key masking mistake still moves most outputs by more.
- Chunk padding (prefill queries at or past lengths[p]) is checked for finiteness only: the docstring says
  nobody reads those values, and the kernel skips their keys.
- The prefill kernel's options keep these tolerances. exp2 (base-2 softmax) changes only the fp32 rounding of
  the exponent arguments; lazy_rescale leaves p = exp(s - m) with a stale max m up to 2^8: the fp32 sums add
  the same terms times one common factor per row, and in bf16 each p is still one 2^-9 relative rounding
  (bf16 has fp32's exponent range), so the arguments above hold. Measured at 4B heads (16/4 x 256, 3 rows of
  up to 56 keys, block_k 16): fp32 max |o - ref| 2.0e-6 with exp, 1.8e-6 with exp2, the same with lazy
  rescaling; bf16 max |o - ref| is 0.70 of the tolerance with every option (0.48 of it between the lazy and
  the plain kernel). hoist_index reads the same keys: bit-identical results.
- `prefill_softmax_step` on its own (fp32, no Pallas): the final o / l against a float64 softmax at
  atol = rtol = 1e-5 (the fp32 argument above), and the running max after each block against a float64
  simulation of the lazy rule at rtol 1e-6 (one fp32 rounding of max * scale).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200
from test_kernels_gdn_decode import triton_modules  # the Triton IR of a lowered pallas_call

from qwen35_jax.kernels.decode_attention import (
    dot_precision,
    empty_softmax_state,
    normalise,
    paged_decode_attention_pallas,
    paged_decode_attention_ref,
)
from qwen35_jax.kernels.prefill_attention import (
    RESCALE_THRESHOLD,
    paged_prefill_attention_pallas,
    paged_prefill_attention_ref,
    prefill_softmax_step,
)

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2**-7, rtol=2**-7)}
DTYPES = [pytest.param(jnp.float32, id="fp32"), pytest.param(jnp.bfloat16, id="bf16")]
LAYERS = 2
LAYER = 1  # the last layer of the pool: a kernel that ignores `layer` reads layer 0 and fails


def make_pool(rng, num_pages, page_size, kv_heads, dim, dtype):
    """Random K and V pools [LAYERS, num_pages, page_size, KV, D]."""
    shape = (LAYERS, num_pages, page_size, kv_heads, dim)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(2))


def make_page_table(rng, tokens_per_row, page_size, width):
    """[R, width] int32: distinct random pages (never 0) for each row's tokens, 0 elsewhere; and the pool size."""
    needed = [-(-n // page_size) for n in tokens_per_row]
    pages = rng.permutation(np.arange(1, sum(needed) + 1))
    table = np.zeros((len(needed), width), np.int32)
    used = 0
    for row, n in enumerate(needed):
        table[row, :n] = pages[used : used + n]
        used += n
    return jnp.asarray(table), sum(needed) + 1


def check_close(out, ref, dtype, mask=None):
    assert out.dtype == dtype and out.shape == ref.shape
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    if mask is not None:
        out, ref = out[mask], ref[mask]
    np.testing.assert_allclose(out, ref, **TOL[dtype])


# ---- decode ------------------------------------------------------------------------------------------------


def decode_case(rng, lengths, heads, kv_heads, dim, page_size, dtype, padding_rows=0, width=None):
    """Inputs for rows of `lengths` cached tokens, then `padding_rows` rows as the runner pads them."""
    width = width or -(-max(lengths) // page_size) + 1
    table, num_pages = make_page_table(rng, lengths, page_size, width)
    table = jnp.concatenate([table, jnp.zeros((padding_rows, width), jnp.int32)])
    lengths = jnp.asarray(list(lengths) + [1] * padding_rows, jnp.int32)
    k_pages, v_pages = make_pool(rng, num_pages, page_size, kv_heads, dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), heads, dim), np.float32), dtype)
    return q, k_pages, v_pages, jnp.int32(LAYER), table, lengths


def run_decode(args, **options):
    return jax.jit(lambda *a: paged_decode_attention_pallas(*a, interpret=True, **options))(*args)


@pytest.mark.parametrize(
    "page_size, block_k, num_splits",
    [(16, 16, 1), (16, None, 3), (8, 16, None), (32, 16, 5)],
    ids=["ps16-one-split", "ps16-default-block-3-splits", "ps8-block-spans-pages", "ps32-page-spans-blocks"],
)
def test_decode_matches_ref_on_ragged_rows(page_size, block_k, num_splits):
    """Lengths 1, a page minus one, a page, a page plus one (page boundaries) and a long row that is no
    multiple of the page size or block, plus a padding row; uneven splits leave some splits empty."""
    rng = np.random.default_rng([page_size, block_k or 0, num_splits or 0])
    lengths = [1, page_size - 1, page_size, page_size + 1, 3 * page_size + 5]
    args = decode_case(rng, lengths, heads=8, kv_heads=2, dim=32, page_size=page_size, dtype=jnp.float32,
                       padding_rows=1)  # fmt: skip
    out = run_decode(args, block_k=block_k, num_splits=num_splits)
    check_close(out, paged_decode_attention_ref(*args), jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_gqa4_head256(dtype):
    """The 4B head layout: 16 query heads over 4 KV heads of 256, group 4 packed into one tile."""
    rng = np.random.default_rng(4)
    args = decode_case(rng, [37, 70], heads=16, kv_heads=4, dim=256, page_size=16, dtype=dtype)
    out = run_decode(args, block_k=32, num_splits=2)
    check_close(out, paged_decode_attention_ref(*args), dtype)


def test_decode_reads_nothing_past_length():
    """The tail of each row's last page and the unused page-table entries hold NaN pages or garbage ids; the
    kernel must give the reference's result on the clean cache, so it never read them."""
    rng = np.random.default_rng(7)
    page_size, lengths = 16, [5, 21, 40]
    q, k_pages, v_pages, layer, table, lengths_arr = decode_case(
        rng, lengths, heads=4, kv_heads=2, dim=32, page_size=page_size, dtype=jnp.float32, width=5
    )
    ref = paged_decode_attention_ref(q, k_pages, v_pages, layer, table, lengths_arr)
    k_bad, v_bad, bad_table = poison(k_pages, v_pages, table, [0] * len(lengths), lengths, page_size)
    out = run_decode((q, k_bad, v_bad, layer, bad_table, lengths_arr), block_k=16, num_splits=2)
    check_close(out, ref, jnp.float32)


def poison(k_pages, v_pages, table, start, lengths, page_size):
    """NaN at every cached position >= start + length of each row, in the trash page 0 and in a spare last
    page; unused table entries become out-of-range ids (clamped to the NaN page in interpret mode)."""
    table = np.array(table)
    k_pages, v_pages = np.array(k_pages), np.array(v_pages)
    for row, (s, n) in enumerate(zip(start, lengths, strict=True)):
        end = s + n
        used = -(-end // page_size) if end else 0
        for position in range(end, used * page_size):
            for pages in (k_pages, v_pages):
                pages[:, table[row, position // page_size], position % page_size] = np.nan
        table[row, used:] = 10**6
    for pages in (k_pages, v_pages):
        pages[:, 0] = np.nan
    k_pages = np.concatenate([k_pages, np.full_like(k_pages[:, :1], np.nan)], axis=1)
    v_pages = np.concatenate([v_pages, np.full_like(v_pages[:, :1], np.nan)], axis=1)
    return jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table)


# ---- prefill -----------------------------------------------------------------------------------------------


def prefill_case(rng, starts, lengths, chunk, heads, kv_heads, dim, page_size, dtype, width=None):
    """Rows with `starts` tokens cached before a chunk of `lengths` valid tokens (padded to `chunk`); a row
    of length 0 is a padding row (page table all 0, start 0)."""
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    width = width or -(-max(ends) // page_size) + 1
    table, num_pages = make_page_table(rng, ends, page_size, width)
    k_pages, v_pages = make_pool(rng, num_pages, page_size, kv_heads, dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(starts), chunk, heads, dim), np.float32), dtype)
    start, length = jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32)
    return q, k_pages, v_pages, jnp.int32(LAYER), table, start, length


def run_prefill(args, **options):
    return jax.jit(lambda *a: paged_prefill_attention_pallas(*a, interpret=True, **options))(*args)


def compare_prefill(out, ref, lengths, dtype):
    """Valid queries (chunk index < lengths[p]) against the reference; every output finite."""
    valid = np.arange(ref.shape[1])[None, :] < np.asarray(lengths)[:, None]  # [P, T]
    check_close(out, ref, dtype, np.broadcast_to(valid[:, :, None, None], ref.shape))


@pytest.mark.parametrize(
    "page_size, block_q, block_k, heavy_first",
    [(16, None, 16, False), (8, 4, 16, False), (32, 8, 8, False), (8, 4, 16, True)],
    ids=["ps16-default-q-block", "ps8-small-q-blocks", "ps32-small-k-blocks", "ps8-small-q-blocks-heavy-first"],
)
def test_prefill_matches_ref_on_ragged_rows(page_size, block_q, block_k, heavy_first):
    """A fresh prompt filling the chunk; a chunk starting 3 tokens before a page boundary with a ragged
    length; a one-token chunk after a long prefix; a padding row. The chunk (24) is no multiple of the
    query block, so the wrapper pads it. heavy_first walks the query blocks backwards: same result."""
    rng = np.random.default_rng(page_size)
    chunk = 24
    starts, lengths = [0, page_size - 3, 2 * page_size + 7, 0], [chunk, chunk - 5, 1, 0]
    args = prefill_case(rng, starts, lengths, chunk, heads=8, kv_heads=2, dim=32, page_size=page_size,
                        dtype=jnp.float32)  # fmt: skip
    out = run_prefill(args, block_q=block_q, block_k=block_k, heavy_first=heavy_first)
    compare_prefill(out, paged_prefill_attention_ref(*args), lengths, jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_gqa4_head256(dtype):
    """4B head layout; one chunk continues a 21-token prefix across the page boundary at 32."""
    rng = np.random.default_rng(5)
    starts, lengths = [21, 0], [16, 11]
    args = prefill_case(rng, starts, lengths, 16, heads=16, kv_heads=4, dim=256, page_size=16, dtype=dtype)
    out = run_prefill(args, block_k=16)
    compare_prefill(out, paged_prefill_attention_ref(*args), lengths, dtype)


# The prefill kernel's softmax options (exp2 and the hoisted page index are the defaults; the plain tests above
# run them), each against the reference on the ragged cases: exp as before, lazy rescaling in both domains, the
# per-lane page index, and lazy rescaling with the hoisted index.
PREFILL_OPTIONS = [
    pytest.param(dict(exp2=False), id="exp"),
    pytest.param(dict(exp2=False, lazy_rescale=True), id="exp-lazy"),
    pytest.param(dict(exp2=True, lazy_rescale=True), id="exp2-lazy"),
    pytest.param(dict(hoist_index=False), id="per-lane-index"),
    pytest.param(dict(exp2=True, lazy_rescale=True, hoist_index=True), id="exp2-lazy-hoist"),
]


@pytest.mark.parametrize("options", PREFILL_OPTIONS)
@pytest.mark.parametrize(
    "page_size, block_q, block_k",
    [(8, 4, 16), (32, 8, 8)],
    ids=["ps8-block-spans-pages", "ps32-blocks-within-a-page"],
)
def test_prefill_options_match_ref_on_ragged_rows(page_size, block_q, block_k, options):
    """Ragged rows as in the test above (a fresh prompt; a chunk starting 3 tokens before a page boundary with a
    ragged length; a one-token chunk after a long prefix; padding queries and a padding row of length 0), with
    longer prefixes so that several key blocks of a row are unmasked, with each option. The two tilings take
    the two paths of hoist_index: a key block over whole pages, and key blocks within one page."""
    rng = np.random.default_rng(page_size)
    chunk = 24
    starts, lengths = [0, 4 * page_size - 3, 8 * page_size + 7, 0], [chunk, chunk - 5, 1, 0]
    args = prefill_case(rng, starts, lengths, chunk, heads=8, kv_heads=2, dim=32, page_size=page_size,
                        dtype=jnp.float32)  # fmt: skip
    out = run_prefill(args, block_q=block_q, block_k=block_k, heavy_first=True, **options)
    compare_prefill(out, paged_prefill_attention_ref(*args), lengths, jnp.float32)


def with_jumps(args, jumps, page_size):
    """Prefill inputs whose queries all lean on the direction u = ones / sqrt(D) (q += 4 u, so q.u ~ 4 +- 1),
    with the key at each (row, position) of `jumps` set to `size` u in every KV head: its score is about
    4 * size * D^-0.5, far above the others' (~N(0, 1.2^2)), so the max of the queries that see it jumps."""
    q, k_pages, v_pages, layer, table, start, length = args
    dim = q.shape[-1]
    u = np.ones(dim, np.float32) / np.sqrt(dim)
    q = jnp.asarray(np.asarray(q, np.float32) + 4 * u, q.dtype)
    k = np.array(k_pages, np.float32)
    for (row, position), size in jumps.items():
        k[LAYER, int(table[row, position // page_size]), position % page_size] = size * u
    return q, jnp.asarray(k, k_pages.dtype), v_pages, layer, table, start, length


@pytest.mark.parametrize(
    "options",
    [pytest.param(dict(exp2=True), id="exp2"), pytest.param(dict(exp2=True, lazy_rescale=True), id="exp2-lazy"),
     pytest.param(dict(exp2=False, lazy_rescale=True), id="exp-lazy")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_max_jumps_mid_row(dtype, options):
    """A key late in a row raises the max of the queries that see it far past the lazy threshold (2^8): row 0
    at position 17 by about 150 natural units (2^216: a kernel that kept the stale max would overflow exp to
    inf and give NaN), row 1 at position 28 by about 8 (2^11, rescaled though no overflow would force it).
    Queries before those positions and the other key blocks (random scores, whose max grows by less than the
    threshold: the lazy branch not taken) as usual; padding (row 1's last 4 queries, row 2 of length 0) as in
    the ragged tests."""
    rng = np.random.default_rng(12)
    page_size, chunk, dim = 8, 24, 32
    starts, lengths = [0, 13, 0], [chunk, chunk - 4, 0]
    args = prefill_case(rng, starts, lengths, chunk, heads=8, kv_heads=2, dim=dim, page_size=page_size, dtype=dtype)
    args = with_jumps(args, {(0, 17): 210.0, (1, 28): 14.0}, page_size)
    ref = paged_prefill_attention_ref(*args)
    out = run_prefill(args, block_q=4, block_k=8, **options)
    compare_prefill(out, ref, lengths, dtype)
    # The jump is real: queries of row 0 that see position 17 attend (almost) only to it.
    v_jump = np.asarray(args[2], np.float32)[LAYER, int(args[4][0, 17 // page_size]), 17 % page_size]  # [KV, D]
    np.testing.assert_allclose(np.asarray(ref, np.float32)[0, 17:].reshape(7, 2, 4, dim),
                               np.broadcast_to(v_jump[None, :, None], (7, 2, 4, dim)), **TOL[dtype])  # fmt: skip


def lazy_rule_trajectory(block_max, threshold):
    """The running max after each block under the lazy rule, in float64: rows keep their max unless some row's
    block max exceeds its own by more than `threshold`; then every row takes its exact running max."""
    m = np.full(block_max.shape[1], -np.inf)
    trajectory, taken = [], []
    for bm in block_max:
        with np.errstate(invalid="ignore"):
            grows = bool(np.any(bm > m + threshold))
        if grows:
            m = np.maximum(m, bm)
        trajectory.append(m.copy())
        taken.append(grows)
    return np.array(trajectory), taken


@pytest.mark.parametrize("exp2", [False, True], ids=["exp", "exp2"])
def test_prefill_softmax_step_rescales_lazily(exp2):
    """`prefill_softmax_step` over 7 key blocks of raw scores (fp32): row 0 never sees a key (o = 0, l = 0,
    m = -inf, no NaN), row 1 sees none in the first two blocks, row 2 gets a key 150 natural units above its
    max in block 4 (2^216: overflow unless rescaled), row 3 one about 7 above in block 3 (2^10). With
    lazy rescaling the running max stays stale across blocks where no row grows by more than 2^8 (checked
    to happen, for a row whose max did grow) and is exact after the others; without it, always exact. Both
    give softmax(scale * scores) v."""
    rng = np.random.default_rng(13)
    blocks, rows, block_k, dim, scale = 7, 4, 8, 16, 0.25
    raw = (4 * rng.standard_normal((blocks, rows, block_k))).astype(np.float32)  # scale * raw ~ N(0, 1)
    raw[:, 0] = -np.inf
    raw[:2, 1] = -np.inf
    raw[4, 2, 3] = 150 / scale
    raw[3, 3, 5] = raw[:3, 3].max() + 7 / scale
    v = rng.standard_normal((blocks, block_k, dim)).astype(np.float32)
    factor = scale * (math.log2(math.e) if exp2 else 1.0)
    threshold = RESCALE_THRESHOLD * (1.0 if exp2 else math.log(2.0))
    block_max = raw.astype(np.float64).max(axis=-1) * factor  # [blocks, rows]
    exact = np.maximum.accumulate(block_max, axis=0)
    lazy, taken = lazy_rule_trajectory(block_max, threshold)
    assert taken[0] and any(taken[1:]) and not all(taken[1:]), taken  # the branch goes both ways mid-row
    assert (lazy < exact).any()  # some row runs on a stale max
    weights = np.exp(raw.astype(np.float64) * scale).transpose(1, 0, 2).reshape(rows, -1)  # finite: max 150
    expected = weights @ v.reshape(-1, dim).astype(np.float64) / np.maximum(weights.sum(axis=1), 1e-300)[:, None]

    for threshold_option, trajectory in ((RESCALE_THRESHOLD, lazy), (None, exact)):
        step = jax.jit(functools.partial(prefill_softmax_step, precision=dot_precision(jnp.float32), scale=scale,
                                         exp2=exp2, rescale_threshold=threshold_option))  # fmt: skip
        carry = empty_softmax_state(rows, dim)
        for block in range(blocks):
            carry = step(carry, jnp.asarray(raw[block]), jnp.asarray(v[block]))
            o, m, l = (np.asarray(x) for x in carry)
            assert np.isfinite(o).all() and np.isfinite(l).all(), block
            assert (o[0] == 0).all() and l[0] == 0 and m[0] == -np.inf
            np.testing.assert_allclose(m[1:], trajectory[block, 1:], rtol=1e-6, atol=0)
            assert (m[1] == -np.inf) == (block < 2)
        np.testing.assert_allclose(np.asarray(normalise(*carry[::2])), expected, **TOL[jnp.float32])


def test_prefill_reads_nothing_past_the_chunk():
    """NaN past each chunk's end, in the trash page and behind garbage table ids: valid queries still match
    the reference on the clean cache and padding queries stay finite."""
    rng = np.random.default_rng(9)
    page_size, chunk = 8, 16
    starts, lengths = [5, 0, 0], [9, 16, 0]
    q, k_pages, v_pages, layer, table, start, length = prefill_case(
        rng, starts, lengths, chunk, heads=4, kv_heads=2, dim=32, page_size=page_size, dtype=jnp.float32, width=6
    )
    ref = paged_prefill_attention_ref(q, k_pages, v_pages, layer, table, start, length)
    k_bad, v_bad, bad_table = poison(k_pages, v_pages, table, starts, lengths, page_size)
    out = run_prefill((q, k_bad, v_bad, layer, bad_table, start, length), block_q=4, block_k=8)
    compare_prefill(out, ref, lengths, jnp.float32)


# ---- shared ------------------------------------------------------------------------------------------------


def test_wrappers_hold_no_nested_jit():
    """The XLA code around each pallas_call is lax primitives only: the model calls these kernels inside
    stream-annotated regions, where a nested jit (jnp.pad, jnp.where) fails at run time."""
    shape = jax.ShapeDtypeStruct
    i32 = jnp.int32
    pages = shape((LAYERS, 8, 16, 2, 32), jnp.float32)
    decode = jax.make_jaxpr(lambda *a: paged_decode_attention_pallas(*a, interpret=True))(
        shape((3, 6, 32), jnp.float32), pages, pages, shape((), i32), shape((3, 4), i32), shape((3,), i32)
    )
    prefill = jax.make_jaxpr(lambda *a: paged_prefill_attention_pallas(*a, interpret=True))(
        shape((3, 20, 6, 32), jnp.float32), pages, pages, shape((), i32), shape((3, 4), i32), shape((3,), i32),
        shape((3,), i32),
    )  # fmt: skip
    for jaxpr in (decode, prefill):
        names = [eqn.primitive.name for eqn in jaxpr.eqns]
        assert "pallas_call" in names and not {"jit", "pjit", "closed_call"} & set(names), names


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize(
    "options",
    [pytest.param(dict(exp2=False), id="exp"), pytest.param({}, id="defaults"),
     pytest.param(dict(lazy_rescale=True), id="exp2-lazy"), pytest.param(dict(hoist_index=False), id="per-lane")],
)  # fmt: skip
def test_prefill_lowers_to_triton_for_h200(options):
    """The 4B prefill at an 8192-token chunk (grid 1 x 4 KV heads x 256 query blocks) through the Triton lowering
    for an abstract H200, with each option: exp2 calls libdevice's exp2f instead of expf, lazy rescaling is an
    scf.if inside the unmasked key loop (the first scf.for), and the hoisted index leaves no per-lane division
    or remainder in that loop."""
    spec = jax.ShapeDtypeStruct
    pages = spec((LAYERS, 600, 16, 4, 256), jnp.bfloat16)
    args = (spec((1, 8192, 16, 256), jnp.bfloat16), pages, pages, spec((), jnp.int32), spec((1, 512), jnp.int32),
            spec((1,), jnp.int32), spec((1,), jnp.int32))  # fmt: skip
    lowered = lower_for_h200(functools.partial(paged_prefill_attention_pallas, **options), *args)
    assert re.findall(r"grid_[xyz] = (\d+)", lowered.as_text()) == ["1", "4", "256"]
    [triton] = triton_modules(lowered)
    exp2 = options.get("exp2", True)
    assert ("__nv_exp2f" in triton, "__nv_expf" in triton) == (exp2, not exp2)
    unmasked_loop = triton[triton.index("scf.for") : triton.index("scf.yield")]
    assert ("scf.if" in unmasked_loop) == options.get("lazy_rescale", False)
    per_lane_index = re.findall(r"arith\.(?:divsi|remsi) .* : tensor<64xi32>", unmasked_loop)
    assert bool(per_lane_index) != options.get("hoist_index", True), per_lane_index


# ---- GPU, 4B shapes ----------------------------------------------------------------------------------------


def gpu_ref(ref, args):
    """The reference on the GPU with IEEE fp32 dots (XLA may otherwise use TF32 for fp32; the kernel does not)."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(ref)(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("page_size", [16, 32])
def test_gpu_decode_4b(batch, page_size):
    rng = np.random.default_rng(batch)
    lengths = rng.integers(1, 4096, batch).tolist()
    lengths[0] = 1
    args = decode_case(rng, lengths, heads=16, kv_heads=4, dim=256, page_size=page_size, dtype=jnp.bfloat16,
                       padding_rows=1, width=4096 // page_size)  # fmt: skip
    out = jax.jit(paged_decode_attention_pallas)(*args)
    check_close(out, gpu_ref(paged_decode_attention_ref, args), jnp.bfloat16)


# The 4B GPU prefill cases: a long chunk fresh and after a 1000-token prefix, a short one after 3000 and 7 tokens.
GPU_PREFILL_CASES = pytest.mark.parametrize("chunk, starts", [(512, [0, 1000]), (16, [3000, 7])],
                                            ids=["long-chunk", "short-chunk"])  # fmt: skip


def gpu_prefill_case(rng, dtype, chunk, starts):
    """(args, lengths): two rows of `chunk` and chunk - 3 valid tokens after `starts`, then a padding row; 4B heads,
    pages of 16, a table 4096 tokens wide."""
    lengths = [chunk, chunk - 3, 0]
    args = prefill_case(rng, starts + [0], lengths, chunk, heads=16, kv_heads=4, dim=256, page_size=16, dtype=dtype,
                        width=4096 // 16)  # fmt: skip
    return args, lengths


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@GPU_PREFILL_CASES
def test_gpu_prefill_4b(dtype, chunk, starts):
    args, lengths = gpu_prefill_case(np.random.default_rng(chunk), dtype, chunk, starts)
    ref = gpu_ref(paged_prefill_attention_ref, args)
    for options in ({}, dict(exp2=False), dict(lazy_rescale=True), dict(hoist_index=False)):
        out = jax.jit(functools.partial(paged_prefill_attention_pallas, **options))(*args)
        compare_prefill(out, ref, lengths, dtype)


@pytest.mark.gpu
def test_gpu_pool_over_4_gib_uses_64_bit_offsets():
    """A pool past 4 GiB per array makes the Triton lowering switch to 64-bit offsets; read its last pages."""
    page_size, kv_heads, dim, layers, num_pages = 16, 4, 256, 8, 36000  # 9.4 GB per pool
    rng = np.random.default_rng(0)
    fill = jnp.asarray(rng.standard_normal((layers, 64, page_size, kv_heads, dim), np.float32), jnp.bfloat16)
    pool = jax.jit(lambda last: jnp.zeros((layers, num_pages, page_size, kv_heads, dim), jnp.bfloat16)
                   .at[:, num_pages - 64 :].set(last))  # fmt: skip
    k_pages, v_pages = pool(fill), pool(-fill)
    table = jnp.asarray(np.arange(num_pages - 64, num_pages, dtype=np.int32).reshape(2, 32))
    q = jnp.asarray(rng.standard_normal((2, 16, dim), np.float32), jnp.bfloat16)
    args = (q, k_pages, v_pages, jnp.int32(layers - 1), table, jnp.asarray([500, 512], jnp.int32))
    out = jax.jit(paged_decode_attention_pallas)(*args)
    check_close(out, gpu_ref(paged_decode_attention_ref, args), jnp.bfloat16)
